"""Two real S3 servers on loopback for the bucket weight store's tests (rft.weights.bucket): rft's own object server
(`python -m rft.broker.objects`, with its access log) and moto's server mode (`moto_server`, from PyPI, in its own
venv: `make moto`, requirements/moto.txt). Both honour conditional PUTs (If-None-Match: *, If-Match: ETAG), which the
store's LATEST and manifests rely on. Each counts the GETs of an object key from its request log.

`S3_ENV`: the credentials and region a client needs (neither server checks them); setting them also keeps the client
from asking an instance-metadata endpoint for credentials.
"""
from __future__ import annotations

import os
import re
import subprocess
import urllib.request
from pathlib import Path

from rft.broker.objects import ObjectServer
from tests.waiting import tail_of, wait_until

REPO = Path(__file__).resolve().parents[1]
MOTO_SERVER = Path(os.environ.get("RFT_MOTO_SERVER", REPO / ".cache" / "moto" / "bin" / "moto_server"))
S3_ENV = {"AWS_ACCESS_KEY_ID": "rft-test", "AWS_SECRET_ACCESS_KEY": "rft-test", "AWS_REGION": "us-east-1"}
KINDS = ("rft-objects", "moto")


class S3Server:
    """A running S3 server: `endpoint` (http://127.0.0.1:PORT), `bucket(name)` creates a bucket, `gets(key)`
    counts the GET requests of the objects whose key ends with `key`, `stop()`."""

    def __init__(self, kind: str, workdir: Path):
        self.kind, self.workdir = kind, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / f"{kind}.log"
        if kind == "rft-objects":
            self.requests = workdir / "access.log"
            server = ObjectServer(workdir / "data", access_log=self.requests, output=self.log)
            self.process, self.endpoint = server.process, server.endpoint
            return
        if kind == "moto":
            if not MOTO_SERVER.is_file():
                raise AssertionError(f"moto's S3 server is not installed at {MOTO_SERVER}: run `make moto` "
                                     "(requirements/moto.txt)")
            self.requests = self.log  # werkzeug logs each request: '... "GET /bucket/key HTTP/1.1" 200 -'
            self.process = subprocess.Popen([str(MOTO_SERVER), "-H", "127.0.0.1", "-p", "0"], cwd=workdir,
                                            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
            port = wait_until(lambda: _moto_port(self.log), timeout=60, what="moto_server's port",
                              alive=[self.process], context=tail_of(self.log))
            self.endpoint = f"http://127.0.0.1:{port}"
            return
        raise ValueError(f"unknown S3 server kind {kind!r}: one of {KINDS}")

    def bucket(self, name: str) -> str:
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/{name}", method="PUT"), timeout=10).read()
        return name

    def gets(self, key: str) -> int:
        """GET requests (answered with 200) of objects whose key ends with `key`, so far."""
        text = self.requests.read_text(errors="replace") if self.requests.exists() else ""
        if self.kind == "moto":
            hits = re.findall(r'"GET (\S+) HTTP/[\d.]+" 200', text)
        else:
            hits = re.findall(r"^GET (\S+) 200$", text, flags=re.M)
        return sum(path.split("?")[0].endswith(key) for path in hits)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _moto_port(log: Path) -> str | None:
    if not log.exists():
        return None
    found = re.search(r"Running on http://127\.0\.0\.1:(\d+)", log.read_text(errors="replace"))
    return found.group(1) if found else None
