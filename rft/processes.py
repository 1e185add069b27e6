"""Processes and ports: a leaf module (standard library only), so that light modules such as rft/broker/local.py, the
benchmarks and the tests use the same helpers without importing rft.cli.commandline's dependencies.

- `die_with_parent`: a child process that dies with its parent (Linux); `dying_with_parent`: a command line that does
  so from its start (util-linux's setpriv), and `signals_blocked`: children started with signals blocked, both instead
  of a `preexec_fn`, which is unsafe in a process with threads (the child may deadlock on a lock another thread held).
- `free_port`: a TCP port nothing listens on now; `listening_socket`: a socket listening on one address only;
  `is_loopback`: whether a host name or address is this machine's loopback.
- `signal_group`, `stop_group`: a signal to a child's process group (it was started with `start_new_session=True`);
  a stop that escalates to SIGKILL.
- `command_line`, `matching`, `kill_matching`, `alive`, `wait_gone`: /proc, what runs with which command line.
- `durable_replace` (and `write_durably`, `sync_tree`): the one way a file or directory that a resume reads is put
  in place, so that it survives a power loss (fsync of its contents, the rename, fsync of the directory).
"""
from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child process: ask Linux to send `sig` when the parent dies (no-op elsewhere). Linux tracks the parent
    *thread*: a child started from a thread that ends gets `sig` then."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def dying_with_parent(command: list[str], sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """`command` started through util-linux's `setpriv --pdeathsig`, so that Linux sends `sig` to it when the thread
    that starts it dies (before it runs a line, with no `preexec_fn`); `command` itself where setpriv is missing (not
    Linux, or util-linux lacks it: the child then outlives a parent killed outright)."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    return [setpriv, f"--pdeathsig={sig.name.removeprefix('SIG')}", "--", *command] if setpriv else list(command)


@contextlib.contextmanager
def signals_blocked(signals: Collection[int]) -> Iterator[None]:
    """Within the block, `signals` are blocked in this thread, so a child it starts begins with them blocked (fork
    and exec keep the thread's mask) until it installs its handlers and unblocks them; the mask is restored after,
    and a signal that came meanwhile is delivered then."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(signals)) if signals else None
    try:
        yield
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` ("" and "localhost" mean 127.0.0.1) that was free a moment ago: the kernel's pick for
    a bind to port 0, released at once. Another process may take it before the caller binds it."""
    with socket.socket() as s:
        s.bind((host if host not in ("", "localhost") else "127.0.0.1", 0))
        return s.getsockname()[1]


def listening_socket(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A TCP socket bound to `host`'s first address (a name is resolved; "localhost" is loopback) and `port` (0: a
    free one), listening: for servers whose library binds every interface unless handed a socket (torch's TCPStore:
    `master_listen_fd`). OSError naming the address when it cannot be bound."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise OSError(f"cannot resolve {host!r}: {e.strerror or e}") from None
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(backlog)
    except OSError as e:
        listener.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return listener


def signal_group(process: subprocess.Popen | int, sig: int) -> bool:
    """`sig` to the process group that `process` (a Popen, or a pid) leads: a child started with
    `start_new_session=True` and everything it started in its session. False when the group is gone already (or
    may not be signalled); True when the signal was sent."""
    pid = process if isinstance(process, int) else process.pid
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_group(process: subprocess.Popen, first: int = signal.SIGTERM, timeout_s: float = 10) -> int:
    """Stop the process group `process` leads: `first` (when it still runs), SIGKILL after `timeout_s`; waits for
    `process` and returns its exit status."""
    if process.poll() is None:
        signal_group(process, first)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        signal_group(process, signal.SIGKILL)
        return process.wait()


def command_line(pid: int) -> str | None:
    """The command line of process `pid`, its arguments joined by spaces ("" for a zombie or a kernel thread), or
    None when there is no such process (or /proc does not say)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def matching(*needles: str) -> list[int]:
    """The pids of the live processes (zombies excluded) whose command line contains all `needles`, this process
    left out."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        cmdline = command_line(int(entry.name))
        if cmdline and all(n in cmdline for n in needles):
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie, exited and not reaped yet, is not alive)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()  # after "pid (name)"
    except OSError:
        return False
    return bool(state) and state[0] != "Z"


def kill_matching(*needles: str, sig: int = signal.SIGKILL) -> list[int]:
    """`sig` (SIGKILL) to every process whose command line contains all `needles` (`matching`); returns the pids
    it was sent to."""
    killed = []
    for pid in matching(*needles):
        try:
            os.kill(pid, sig)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def wait_gone(pid: int, timeout_s: float = 10) -> bool:
    """Until process `pid` is no longer `alive` (a child of this process is reaped once it exits; another's zombie
    is left to its parent); False when it still runs after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child
            pass
        if not alive(pid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1, bracketed or not); False for wildcards and
    everything else (a name is not resolved)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _fsync(path: str | os.PathLike) -> None:
    """fsync one file or directory by its path."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(path: str | os.PathLike, *, recursive: bool = True) -> None:
    """fsync `path`: a file, or a directory with (`recursive`) every file and directory under it (symlinks are not
    followed)."""
    path = Path(path)
    if recursive and path.is_dir() and not path.is_symlink():
        for parent, dirs, files in os.walk(path):
            for name in files:
                if not os.path.islink(os.path.join(parent, name)):
                    _fsync(os.path.join(parent, name))
            for name in dirs:
                if os.path.islink(os.path.join(parent, name)):
                    continue
                _fsync(os.path.join(parent, name))
    _fsync(path)


def durable_replace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Put `src` (a complete file or directory) in place as `dst` so that after a power loss `dst` is either the old
    one or all of `src`: fsync of `src` (a directory: everything under it, `sync_tree`), `os.replace`, then fsync of
    `dst`'s directory (the rename itself). A directory `dst` must not exist or be empty (rename(2))."""
    sync_tree(src)
    os.replace(src, dst)
    _fsync(Path(dst).parent)


def write_durably(path: str | os.PathLike, data: str | bytes) -> None:
    """`data` at `path`, visible whole or not at all, and durable once this returns (written aside, then
    `durable_replace`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        durable_replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
