"""Who may call rft's HTTP endpoints (`rft serve`, `rft dashboard`; FastAPI): bearer keys, a Host allow-list and
JSON-only requests, checked before a route runs. The trust model is in docs/security.md.

Contract of `Access.check` (the FastAPI dependency `Access.dependency` calls it), in this order:
  1. Host: the request's Host header (without its port, case-insensitive) is in the allow-list, else 400
     (DNS rebinding: a page on an attacker's name that resolves to 127.0.0.1 is refused by name).
  2. Key: with keys configured, a bearer key (`Authorization: Bearer KEY`; where `cookie` is set, also that cookie
     or, on the page `/` only, a `?key=` query parameter, for a browser: the page sets the cookie and redirects to
     itself without the key) equal to one of them (compared in constant time), else 401 with
     `WWW-Authenticate: Bearer`. Without keys everyone passes: `require_keys` lets that happen on loopback only.
  3. Content type: a request with a body (POST, PUT, PATCH) is `application/json`, else 415, so a cross-site
     "simple" POST (text/plain, a form) from a web page is refused before anything reads it.
Keys come from an environment variable (comma-separated) and/or a file (one per line, `#` comments): both are
named in the config, the keys themselves never are, so they are never written to the run directory.
"""
from __future__ import annotations

import hmac
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request, params
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rft.processes import is_loopback

if TYPE_CHECKING:
    from rft.observability.config import MonitorConfig
    from rft.serve.config import ServeConfig

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("", "0.0.0.0", "::")
BODY_METHODS = ("POST", "PUT", "PATCH")
# the `Authorization: Bearer` credentials of a request, None without them (the key check decides)
BearerCredentials = Annotated[HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))]


class AccessDenied(Exception):
    """A request refused before its route ran: `status` (400, 401, 415), a one-line message, response headers."""

    def __init__(self, status: int, message: str, *, code: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.headers = status, code, headers or {}


class AccessConfigError(ValueError):
    """The keys cannot be read, or an endpoint beyond loopback has none: the message says what to set."""


def load_keys(*, env: str, file: str, what: str) -> frozenset[str]:
    """The bearer keys of `what` (e.g. "serve"): from the environment variable named `env` (comma-separated) and the
    file `file` (one per line; blank lines and `#` comments skipped). AccessConfigError naming the file when it
    cannot be read; a key shorter than 16 characters is refused (a guessable key is no key)."""
    keys = [k.strip() for k in os.environ.get(env, "").split(",")] if env else []
    if file:
        try:
            text = Path(file).expanduser().read_text()
        except OSError as e:
            raise AccessConfigError(f"{what}: cannot read the key file {file}: {e.strerror or e}") from None
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    keys = [k for k in keys if k]
    short = [k for k in keys if len(k) < 16]
    if short:
        source = f"${env}" + (f" or {file}" if file else "")
        raise AccessConfigError(f"{what}: a key from {source} has {len(short[0])} characters; use at least 16 (e.g. "
                        "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return frozenset(keys)


def require_keys(host: str, keys: frozenset[str], *, what: str, env: str, file_key: str, host_key: str) -> None:
    """AccessConfigError when `what` would listen on `host` beyond loopback without a key, naming the settings to
    change."""
    if keys or is_loopback(host):
        return
    raise AccessConfigError(f"{what} would listen on {host or '0.0.0.0'} (beyond loopback) without a key: anyone "
                            f"who can reach it could use it. Put a key in the environment variable ${env} (or a "
                            f"file named by {file_key}), or listen on 127.0.0.1 ({host_key}); docs/security.md")


def allowed_hosts(configured: list[str], bind_host: str) -> frozenset[str] | None:
    """The Host names accepted (lower case), None for any (`*` configured). Empty `configured`: the loopback names,
    `bind_host` unless it is a wildcard, and, when it is not loopback, this host's name, FQDN and addresses."""
    if "*" in configured:
        return None
    if configured:
        return frozenset(h.lower().strip("[]") for h in configured)
    names = set(LOOPBACK_NAMES)
    if bind_host not in WILDCARDS:
        names.add(bind_host.strip("[]"))
    if not is_loopback(bind_host):
        hostname = socket.gethostname()
        names |= {hostname, socket.getfqdn()}
        try:
            names |= set(socket.gethostbyname_ex(hostname)[2])
        except OSError:
            pass
    return frozenset(n.lower() for n in names)


def host_name(header: str) -> str:
    """The host of a Host header, without its port and brackets, lower case (`[::1]:8000` -> `::1`)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True)
class Access:
    """The checks of one endpoint (module docstring). `cookie`: the name of a cookie that may carry the key (and
    then `?key=` on LOGIN_PATH too), for a browser page that cannot set headers on its requests; None: the header
    only."""
    keys: frozenset[str]
    hosts: frozenset[str] | None
    cookie: str | None = None

    def key_ok(self, key: str | None) -> bool:
        return key is not None and any(hmac.compare_digest(key.encode(), k.encode()) for k in self.keys)

    def check(self, request: Request, credentials: HTTPAuthorizationCredentials | None) -> None:
        """Raise AccessDenied unless the request passes the three checks (module docstring)."""
        host = host_name(request.headers.get("host", ""))
        if self.hosts is not None and host not in self.hosts:
            raise AccessDenied(400, f"the Host {host!r} is not one this server answers to (allowed: "
                               f"{', '.join(sorted(self.hosts))}; the allowed_hosts setting)", code="host_not_allowed")
        if self.keys:
            offered = [credentials.credentials if credentials else None]
            if self.cookie:
                offered.append(request.cookies.get(self.cookie))
                if request.url.path == LOGIN_PATH:  # a key in any other URL would be kept in logs and histories
                    offered.append(request.query_params.get("key"))
            if not any(self.key_ok(k) for k in offered):
                raise AccessDenied(401, "a valid key is required: send `Authorization: Bearer <key>`",
                                   code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if request.method in BODY_METHODS:
            media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                raise AccessDenied(415, f"the request body must be JSON (Content-Type: application/json), got "
                                   f"{media or 'no Content-Type'}", code="unsupported_media_type")

    def dependency(self) -> params.Depends:
        """A FastAPI dependency running `check` (add it to the app: `FastAPI(dependencies=[...])`)."""

        async def checked(request: Request, credentials: BearerCredentials) -> None:
            self.check(request, credentials)

        return Depends(checked)


def serve_access(serve: ServeConfig, host: str) -> Access:
    """The access of `rft serve` listening on `host` (serve.api_key_env / api_key_file / allowed_hosts).
    AccessConfigError when the keys cannot be read, or `host` is beyond loopback and there is none."""
    keys = load_keys(env=serve.api_key_env, file=serve.api_key_file, what="rft serve")
    require_keys(host, keys, what="rft serve", env=serve.api_key_env, file_key="serve.api_key_file",
                 host_key="serve.host / --host")
    return Access(keys, allowed_hosts(serve.allowed_hosts, host))


DASHBOARD_COOKIE = "rft_dashboard_key"
LOGIN_PATH = "/"  # the one URL a browser may give the key in (`?key=`): it answers with the cookie and a redirect


def dashboard_access(monitor: MonitorConfig, host: str) -> Access:
    """The access of `rft dashboard` listening on `host` (monitor.dashboard_key_env / _key_file / _allowed_hosts);
    a browser gives the key once as `/?key=KEY`, kept in the DASHBOARD_COOKIE cookie. AccessConfigError as
    `serve_access`."""
    keys = load_keys(env=monitor.dashboard_key_env, file=monitor.dashboard_key_file, what="rft dashboard")
    require_keys(host, keys, what="rft dashboard", env=monitor.dashboard_key_env,
                 file_key="monitor.dashboard_key_file", host_key="monitor.dashboard_host / --host")
    return Access(keys, allowed_hosts(monitor.dashboard_allowed_hosts, host), cookie=DASHBOARD_COOKIE)
