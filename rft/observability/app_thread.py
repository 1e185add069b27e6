"""An ASGI app (`rft serve`'s, `rft dashboard`'s) under uvicorn in a thread of this process, for tests and
benchmarks: `url` once `start()` returns, `stop()` ends it. The commands themselves run uvicorn in the foreground."""
from __future__ import annotations

import threading
import time

from rft.processes import free_port


class AppThread:
    """An ASGI `app` under uvicorn in a thread of this process (tests, benchmarks): `url` once `start()` returns;
    `stop()` ends it (within 2 s for open streams)."""

    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0, uds: str | None = None):
        """`uds`: listen on this Unix socket path instead of `host`:`port` (`url` is then `http://localhost`)."""
        import uvicorn

        if uds is not None:
            self.url = "http://localhost"
            config = uvicorn.Config(app, uds=uds, log_level="warning", timeout_graceful_shutdown=2)
        else:
            port = port or free_port(host)
            self.url = f"http://{host}:{port}"
            config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def start(self, timeout_s: float = 30.0) -> AppThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
