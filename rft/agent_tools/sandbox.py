"""The argv that runs a command under resource limits, optionally inside a bubblewrap sandbox (the python tool's,
rft/agent_tools/python.py; reusable for any program that must see only what it needs).

`limited(command, limits)`: `prlimit` sets the `ProcessLimits` on itself and execs the command (no `preexec_fn`:
forking a threaded explorer must not run Python in the child).

`bwrap_command(command, workdir_bytes=..., ro_paths=...)` (bubblewrap, Debian's `bubblewrap`; `sandboxed`: both):
new network, PID, IPC, UTS and cgroup namespaces (no network but its own loopback, abstract Unix sockets included;
its own /proc with no other process in view), bwrap the namespace's init (everything the command started dies with
it), and a root of its own, read-only, holding only:
- /usr (the system's programs and libraries) and the top-level links or directories /bin, /sbin, /lib, /lib32,
  /lib64, /libx32 that lead into it;
- /etc/ld.so.cache, /etc/ld.so.conf, /etc/ld.so.conf.d (the dynamic loader's configuration), nothing else of /etc;
- each of `ro_paths` (e.g. a Python prefix; a Unix socket can be connected to through a read-only bind), bound
  read-only at its own path, the directories above it empty (mode 0755);
- /proc (its own), /dev (bwrap's, read-only: null, zero, full, random, urandom, tty, pts; /dev/shm a private
  tmpfs of `workdir_bytes`), and /tmp: a private tmpfs of `workdir_bytes`, mode 1777, the command's cwd
  (`WORKDIR`). These two are the only writable places.
No home directory, no run directory, no /run, /var or host /tmp, so no Unix socket of the host. When the caller is
root the command runs as a user of its own (setpriv: no capabilities, no new privileges, no groups): a uid drawn at
random per call from `SANDBOX_UIDS`, a range far above the host's users, so that RLIMIT_NPROC counts this call's
tasks only and concurrent calls cannot starve one another (two calls drawing one uid would share their process
budget, nothing else: neither sees the other's processes or files); otherwise bwrap maps the user in a new user
namespace.

`require_tools()` and `check_bwrap(probe)` say why this cannot work here, if it cannot.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

WORKDIR = "/tmp"
SANDBOX_UIDS = range(0x70000000, 0x7FFF0000)  # the command's users when the caller is root (module docstring)
MAX_FILE_BYTES = 1 << 20
MAX_OPEN_FILES = 256
SYSTEM = "/usr"
TOP_LEVEL = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
LOADER_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d")


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot work on this machine (the message says what to do)."""


@dataclass(frozen=True)
class ProcessLimits:
    """Resource limits of a command and everything it starts (each process has its own but `processes`): CPU
    seconds (SIGXCPU at `cpu_s`, SIGKILL a second later), address space, bytes of any one file written, open files,
    no core files, and `processes` (RLIMIT_NPROC: tasks of the user at once, threads included; None: unchanged)."""
    cpu_s: int
    memory_bytes: int
    processes: int | None = None
    file_bytes: int = MAX_FILE_BYTES
    open_files: int = MAX_OPEN_FILES


def limited(command: Sequence[str], limits: ProcessLimits) -> list[str]:
    """`command` run by prlimit(1) under `limits`."""
    args = [_tool("prlimit"), f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={limits.memory_bytes}",
            f"--fsize={limits.file_bytes}", f"--nofile={limits.open_files}", "--core=0"]
    if limits.processes is not None:
        args.append(f"--nproc={limits.processes}")
    return [*args, "--", *command]


def bwrap_command(command: Sequence[str], *, workdir_bytes: int, ro_paths: Sequence[str] = ()) -> list[str]:
    """`command` run in the sandbox of the module docstring, with `ro_paths` (absolute, real paths) bound read-only
    and a /tmp of `workdir_bytes`."""
    args = [_tool("bwrap"), "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--ro-bind", SYSTEM, SYSTEM]
    for top in TOP_LEVEL:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += ["--perms", "0755", "--dir", "/etc"]  # bwrap would make a directory with the caller's umask (077)
    for path in LOADER_FILES:
        args += ["--ro-bind-try", path, path]
    tmpfs = ["--perms", "1777", "--size", str(workdir_bytes), "--tmpfs"]
    args += ["--proc", "/proc", "--dev", "/dev", *tmpfs, "/dev/shm", *tmpfs, WORKDIR]
    made: set[str] = {"/", "/etc", "/dev", "/dev/shm", WORKDIR}
    for path in _outermost(ro_paths):  # after the tmpfs mounts, which would hide one under /tmp
        for above in reversed(PurePosixPath(path).parents):
            if str(above) not in made:
                made.add(str(above))
                args += ["--perms", "0755", "--dir", str(above)]
        args += ["--ro-bind", path, path]
    args += ["--remount-ro", "/dev", "--chdir", WORKDIR, "--remount-ro", "/"]
    command = [_tool("env"), "-u", "PWD", *command]  # bwrap sets PWD: the environment stays the one given
    if os.geteuid() == 0:
        uid = SANDBOX_UIDS[secrets.randbelow(len(SANDBOX_UIDS))]
        return [*args, _tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", *command]
    return [*args, "--unshare-user", *command]


def sandboxed(command: Sequence[str], limits: ProcessLimits, *, workdir_bytes: int,
              ro_paths: Sequence[str] = ()) -> list[str]:
    """`command` under `limits` inside the sandbox (`bwrap_command`): the limits are set inside, as the command's
    user, so that its process count is that user's."""
    return bwrap_command(limited(command, limits), workdir_bytes=workdir_bytes, ro_paths=ro_paths)


def _outermost(paths: Sequence[str]) -> list[str]:
    """`paths` but those inside another one or inside /usr (bound already), sorted."""
    covered = {os.path.normpath(p) for p in paths}
    return sorted(p for p in covered if not any(
        p == q or p.startswith(q.rstrip("/") + "/") for q in (covered - {p}) | {SYSTEM}))


PACKAGES = {"bwrap": "bubblewrap", "prlimit": "util-linux", "setpriv": "util-linux", "env": "coreutils"}


def _tool(name: str) -> str:
    """The absolute path of a program on this PATH (the sandboxed environment has none), or SandboxUnavailable."""
    path = shutil.which(name)
    if path is None:
        raise SandboxUnavailable(f"{name} is not installed here" + ("" if name == "bwrap" else
                                                               f" (Debian's {PACKAGES[name]})"))
    return path


def require_tools(names: Sequence[str] = tuple(PACKAGES)) -> None:
    """SandboxUnavailable naming the first of `names` (the programs `bwrap_command` and `limited` run) not
    installed here."""
    for name in names:
        _tool(name)


def check_bwrap(probe: Sequence[str]) -> None:
    """SandboxUnavailable unless `probe`, a sandboxed argv (`bwrap_command`), exits 0 here."""
    try:
        result = subprocess.run(list(probe), capture_output=True, text=True, timeout=30, env={}, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxUnavailable(f"bwrap does not run here ({e})") from None
    if result.returncode != 0:
        raise SandboxUnavailable(f"bwrap cannot create its sandbox here "
                           f"({result.stderr.strip()[:300] or f'exit status {result.returncode}'})")
