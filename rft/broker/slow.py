"""A TCP proxy that makes a server answer slowly, for faults that cannot be produced otherwise (a slow or stalled
object store: `rft chaos claim-slow`, the claim store's retry tests). `SlowProxy(upstream, delay)` listens on
127.0.0.1 (`port`, `address`) and forwards each connection to `upstream` (host, port); `delay(n)` gives the seconds
the n-th answer of the server (from 0, over all connections; an answer: the bytes that follow a quiet moment) waits
before it reaches the client (0: plain forwarding; `math.inf`: it never does); `refuse(n)`: the n-th connection is
closed at once, as a refused one. Counts `connections` and answers `delayed`. Threads, one pair per connection;
`close()` stops all."""
from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable


class SlowProxy:
    def __init__(self, upstream: tuple[str, int], delay: Callable[[int], float], *,
                 refuse: Callable[[int], bool] = lambda n: False, port: int = 0):
        self.upstream, self.delay, self.refuse = upstream, delay, refuse
        self.answers = 0
        self._server = socket.create_server(("127.0.0.1", port))
        self.port = self._server.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.connections = self.delayed = 0
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="slow-proxy", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                n, self.connections = self.connections, self.connections + 1
            if self.refuse(n):
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        """Copy `src` to `dst`; `answers`: the server's side, each answer held as `delay` says."""
        src.settimeout(None)
        try:
            while not self._closed.is_set():
                data = src.recv(1 << 16)
                if not data:
                    break
                wait = 0.0
                if answers:
                    with self._lock:
                        n, self.answers = self.answers, self.answers + 1
                    wait = self.delay(n)
                    self.delayed += wait > 0
                if wait > 0:
                    if math.isinf(wait):
                        self._closed.wait()
                        break
                    time.sleep(wait)
                    src.settimeout(0.05)  # the rest of this answer goes through at once
                    try:
                        while chunk := src.recv(1 << 16):
                            data += chunk
                    except TimeoutError:
                        pass
                    src.settimeout(None)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        with self._lock:
            for s in self._sockets:
                s.close()

    def __enter__(self) -> SlowProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
