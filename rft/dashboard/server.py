"""`rft dashboard CONFIG [--port P]`: the live run page, served by FastAPI + uvicorn.

Routes:
  GET /                              the page (static/index.html); `?run=A&run=B` selects runs to overlay
  GET /static/{file}                 its script and style (files of this package: nothing loads from elsewhere)
  GET /api/runs                      the runs of the config's output directory (rft.dashboard.model.RunIndex)
  GET /api/runs/{name}/snapshot      one run as JSON (RunWatch.snapshot); 404 naming the runs there if none
  GET /api/runs/{name}/events        server-sent events: a `snapshot` event every EVENT_EVERY_S; the first holds
                                     every metrics record, later ones the records added since (see `snapshot`)

The server keeps running when the run ends, when its broker goes away and when it restarts: the page says which.
Access (rft/observability/access.py, docs/security.md): it listens on monitor.dashboard_host (127.0.0.1 by default;
`--host`); every route checks the Host header (400) and, with keys set (monitor.dashboard_key_env / _key_file,
required beyond loopback), a key (401): `Authorization: Bearer KEY`, or in a browser `/?key=KEY` once, which the
page keeps in an HttpOnly, SameSite=Strict cookie for its own requests, redirecting (303) to itself without the
key so that it stays in no address bar, history or Referer.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from urllib.parse import urlencode

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from rft.cli.commandline import add_config_arguments, config_from_args
from rft.dashboard.model import RunIndex, RunWatch
from rft.observability.access import (
    DASHBOARD_COOKIE,
    LOGIN_PATH,
    Access,
    AccessConfigError,
    AccessDenied,
    allowed_hosts,
    dashboard_access,
)
from rft.run.config import Config

STATIC = Path(__file__).resolve().parent / "static"
STATIC_FILES = {"app.js": "text/javascript", "style.css": "text/css"}
EVENT_EVERY_S = 1.0


def create_app(index: RunIndex, access: Access | None = None) -> FastAPI:
    """The app over `index` (which the caller closes), every route behind `access` (None: no key, loopback Host
    names only)."""
    access = access or Access(frozenset(), allowed_hosts([], "127.0.0.1"), cookie=DASHBOARD_COOKIE)
    app = FastAPI(title="rft dashboard", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[access.dependency()])

    @app.exception_handler(AccessDenied)
    async def denied(request: Request, e: AccessDenied) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, status_code=e.status, headers=e.headers)

    def watch_of(name: str) -> RunWatch:
        watch = index.get(name)
        if watch is None:
            known = ", ".join(r["name"] for r in index.runs())
            raise HTTPException(404, f"no run {name!r} in {index.output_dir} (runs there: {known or 'none'})")
        return watch

    @app.get(LOGIN_PATH)
    def page(request: Request) -> Response:
        key = request.query_params.get("key")
        if key is None:
            return FileResponse(STATIC / "index.html", media_type="text/html")
        # a browser's first visit: keep a valid key in the cookie, and take any key out of the address
        rest = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "key"])
        # relative, so that it also holds behind a proxy that serves the page under a path of its own
        response = RedirectResponse(f"?{rest}" if rest else "./", status_code=303,
                                    headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})
        if access.cookie is not None and access.key_ok(key):
            response.set_cookie(access.cookie, key, httponly=True, samesite="strict",
                                secure=request.url.scheme == "https")
        return response

    @app.get("/static/{name}")
    def static(name: str) -> FileResponse:
        if name not in STATIC_FILES:
            raise HTTPException(404, f"no static file {name!r}")
        return FileResponse(STATIC / name, media_type=STATIC_FILES[name])

    @app.get("/api/runs")
    def runs() -> JSONResponse:
        return JSONResponse({"default": index.cfg.run.name, "output_dir": str(index.output_dir),
                             "runs": index.runs()})

    @app.get("/api/runs/{name}/snapshot")
    def snapshot(name: str) -> JSONResponse:
        return JSONResponse(watch_of(name).snapshot())

    @app.get("/api/runs/{name}/events")
    async def events(name: str, request: Request) -> StreamingResponse:
        watch = watch_of(name)

        async def stream():
            sent, epoch = 0, None
            while not await request.is_disconnected():
                snap = watch.snapshot(since=sent, epoch=epoch)
                sent, epoch = snap["records_total"], snap["records_epoch"]
                yield f"event: snapshot\ndata: {json.dumps(snap)}\n\n"
                await asyncio.sleep(EVENT_EVERY_S)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def serve(cfg: Config, *, host: str, port: int, access: Access) -> None:
    import uvicorn

    index = RunIndex(cfg)
    try:
        print(f"rft dashboard: http://{host}:{port}/ (run {cfg.run.name!r}, runs in {index.output_dir}; "
              f"{'open it as /?key=KEY' if access.keys else 'no key (loopback)'})", flush=True)
        uvicorn.run(create_app(index, access), host=host, port=port, log_level="warning",
                    timeout_graceful_shutdown=2)  # open event streams never end by themselves
    finally:
        index.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft dashboard", description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--port", type=int, default=None, help="TCP port (default: monitor.dashboard_port, or 8265)")
    parser.add_argument("--host", default=None, help="address to listen on (default: monitor.dashboard_host; "
                        "beyond loopback a key is required, docs/security.md)")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    port = args.port or cfg.monitor.dashboard_port or 8265
    host = args.host or cfg.monitor.dashboard_host
    try:
        access = dashboard_access(cfg.monitor, host)
    except AccessConfigError as e:
        print(f"rft dashboard: {e}", file=sys.stderr)
        return 2
    try:
        serve(cfg, host=host, port=port, access=access)
    except OSError as e:
        print(f"rft dashboard: cannot serve on {host}:{port}: {e}", file=sys.stderr)
        return 1
    return 0
