"""Runs an agent program with the recording endpoint at http://127.0.0.1:PORT/v1 (rft/workflows/agent_program.py).

    python -I agent_wrapper.py SOCKET STARTED_FD -- COMMAND [ARG ...]

Inside the sandbox the program has no network but its own loopback, and the endpoint listens on a Unix socket
(SOCKET) bound into it; this wrapper listens on 127.0.0.1 at a free port, forwards every connection to SOCKET, starts
COMMAND with OPENAI_BASE_URL pointing at that port (stdin, stdout, stderr and the rest of the environment inherited),
and exits with its exit status (128 + N when a signal N ended it). It first writes the byte `1` into the
descriptor STARTED_FD (a pipe of the explorer's) and closes it, so the explorer knows that the sandbox started the
program, which never holds that descriptor (nothing it does can unsay it). Standard library only; it imports
nothing of rft (it runs with `-I`, outside the package).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

CHUNK = 1 << 16


def _pipe(source: socket.socket, target: socket.socket) -> None:
    """Copy `source` to `target` until `source` ends, then end `target`'s writing side."""
    try:
        while data := source.recv(CHUNK):
            target.sendall(data)
    except OSError:
        pass
    finally:
        try:
            target.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _forward(client: socket.socket, path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
    back.start()
    _pipe(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _serve(listener: socket.socket, path: str) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_forward, args=(client, path), daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: agent_wrapper.py SOCKET STARTED_FD -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    path, started, command = argv[0], int(argv[1]), argv[3:]
    os.write(started, b"1")
    os.close(started)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    threading.Thread(target=_serve, args=(listener, path), daemon=True).start()
    env = {**os.environ, "OPENAI_BASE_URL": f"http://127.0.0.1:{listener.getsockname()[1]}/v1"}
    try:
        status = subprocess.run(command, env=env).returncode
    except OSError as e:
        print(f"agent_wrapper: cannot start {command[0]!r}: {e}", file=sys.stderr)
        return 127
    return 128 - status if status < 0 else status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
