"""A TCP proxy that makes a server answer slowly, for faults that cannot be produced otherwise (a slow or stalled
object store: `rft chaos claim-slow`, the claim store's retry tests). `SlowProxy(upstream, delay)` listens on
127.0.0.1 (`port`, `address`) and forwards each connection to `upstream` (host, port); `delay(n)` gives the seconds
the n-th connection (from 0) waits before each answer of the server reaches the client (0: plain forwarding;
`math.inf`: it never answers; a negative number: the connection is closed at once, as a refused one). Counts
connections (`connections`) and those delayed (`delayed`). Threads, one pair per connection; `close()` stops all."""
from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable


class SlowProxy:
    def __init__(self, upstream: tuple[str, int], delay: Callable[[int], float]):
        self.upstream, self.delay = upstream, delay
        self._server = socket.create_server(("127.0.0.1", 0))
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
            wait = self.delay(n)
            if wait < 0:
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
                self.delayed += wait > 0
            threading.Thread(target=self._pipe, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, wait), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, wait: float) -> None:
        """Copy `src` to `dst`, holding each answer `wait` s (one answer: bytes that follow a quiet moment)."""
        src.settimeout(None)
        try:
            while not self._closed.is_set():
                data = src.recv(1 << 16)
                if not data:
                    break
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
