"""`python`: a snippet of Python run in a sandboxed subprocess; the answer is what it printed.

The process: `sys.executable -I` (isolated: no PYTHON* variables, no user site, the script's directory not on
the path) reading the code from stdin, in a new session, with an environment of its own (TOOL_ENVIRONMENT: no
proxies, no credentials, no PYTHONPATH), cwd a fresh temporary directory, and `resource` limits set before exec: CPU
time `ceil(timeout_s) + 1` seconds, address space `memory_mb`, files written at most 1 MiB, no core files. The
wall-clock limit is `timeout_s`; past it the whole process group is killed. stdout and stderr go to one file in that
directory (never an unbounded pipe) and the model sees at most `output_chars` characters of it.

The sandbox (`ToolLimits.sandbox`, explorer.python_sandbox), `bwrap` (bubblewrap, Debian's `bubblewrap`, installed by
`make system-deps`): new network, PID, IPC and UTS namespaces (no network but its own loopback: the broker, the
object server and every other listener of the host are out of reach; its own /proc: no other process is in view,
the explorer's environment neither), the whole filesystem bound read-only but for the working directory, and
bwrap as the namespace's init, so that every process the code started dies with the call. When the explorer runs as
root the code runs as `nobody` (setpriv, no capabilities), which also makes the process limit hold (RLIMIT_NPROC
does not bind root): `max_processes` tasks of that user at once; otherwise bwrap maps the user in a new user
namespace and the limit is the user's tasks now plus `max_processes`. `check_sandbox` refuses, with what to do,
when bwrap cannot work here (not installed, or namespaces not allowed); `none` runs without it (trusted code only).

Results: the output (`(no output)` when nothing was printed); on a non-zero exit `error: exit status N` and the
output's last lines (the traceback); on a timeout `error: timed out after X s`. Never raises for the model's code.
No seccomp filter: a kernel exploit is out of scope; the namespaces bound what the code can see and reach.
"""
from __future__ import annotations

import functools
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rft.agent_tools.registry import (
    SandboxError,
    ToolError,
    ToolLimits,
    function_schema,
    register_tool,
    require_arguments,
)
from rft.processes import signal_group

MAX_FILE_BYTES = 1 << 20
SANDBOX_UID = 65534  # nobody: the code's user when the explorer is root
# The code's whole environment: nothing inherited; one thread per math library (a BLAS that starts a thread per core
# of a large machine would run into the process limit)
TOOL_ENVIRONMENT = {"PYTHONIOENCODING": "utf-8", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
                    "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _limit(cpu_s: int, memory_bytes: int, processes: int | None) -> None:
    """Runs in the child between fork and exec. `processes`: RLIMIT_NPROC (None: unchanged)."""
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU at the soft limit, SIGKILL at the hard
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if processes is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))


def sandboxed(command: list[str], workdir: str, sandbox: str) -> list[str]:
    """`command` run inside the sandbox `sandbox` ("bwrap" or "none": as it is) with `workdir` its one writable
    directory and its cwd (see the module docstring)."""
    if sandbox == "none":
        return command
    wrapped = ["bwrap", "--ro-bind", "/", "/", "--bind", workdir, workdir, "--proc", "/proc", "--dev", "/dev",
               "--chdir", workdir, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
               "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    command = ["env", "-u", "PWD", *command]  # bwrap sets PWD: the code's environment stays the one it was given
    if os.geteuid() == 0:
        return wrapped + _reachable(_interpreter_paths()) + [
            "setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", *command]
    return wrapped + ["--unshare-user", *command]


def _interpreter_paths() -> list[str]:
    """The directories the python tool's interpreter needs: this one's prefix and its base installation's (one
    inside another: only the outer one)."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(
        sys.executable)))}
    return sorted(p for p in paths if not any(p.startswith(q + os.sep) for q in paths))


def _reachable(paths: list[str]) -> list[str]:
    """bwrap arguments that let `nobody` reach `paths` when a directory above one is closed to other users (a
    pyenv under /root, mode 0700): that directory becomes an empty tmpfs in the sandbox (mode 0755, the rest of it
    hidden) with each such path bound back into it read-only (the directories on the way: mode 0755)."""
    args: list[str] = []
    masked: set[str] = set()
    for path in paths:
        closed = next((str(a) for a in reversed(Path(path).parents) if not os.stat(a).st_mode & 0o001), None)
        if closed is None:
            continue
        if closed not in masked:
            masked.add(closed)
            args += ["--perms", "0755", "--tmpfs", closed]
        for between in reversed(Path(path).parents):  # the directories on the way, open to others too
            if len(str(between)) > len(closed) and str(between) not in masked:
                masked.add(str(between))
                args += ["--perms", "0755", "--dir", str(between)]
        args += ["--ro-bind", path, path]
    return args


def _process_limit(limits: ToolLimits) -> int | None:
    """RLIMIT_NPROC for the sandboxed code (counted per user, threads included): `max_processes` for `nobody` when
    the explorer is root; else the user's tasks now plus `max_processes`. None without a sandbox."""
    if limits.sandbox == "none":
        return None
    if os.geteuid() == 0:
        return limits.max_processes
    return _tasks_of(os.getuid()) + limits.max_processes


def _tasks_of(uid: int) -> int:
    """Tasks (threads) of user `uid` now, from /proc."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
        except (OSError, StopIteration, ValueError):
            continue  # gone meanwhile
    return total


@functools.cache
def check_sandbox(sandbox: str) -> None:
    """ToolError (naming explorer.python_sandbox and what to do) unless `sandbox` works on this machine: bwrap is
    installed and can create its namespaces here (tried once per process with `true`)."""
    if sandbox == "none":
        return
    fix = ("install bubblewrap (`make system-deps`, or apt-get install bubblewrap) and allow it namespaces (a "
           "container may need --security-opt seccomp=unconfined or unprivileged user namespaces), or set "
           "explorer.python_sandbox: none to run the python tool's code without isolation (trusted code only)")
    if shutil.which("bwrap") is None:
        raise ToolError(f"explorer.python_sandbox: bwrap is not installed here: {fix}")
    with tempfile.TemporaryDirectory(prefix="rft-sandbox-check-") as workdir:
        try:
            probe = subprocess.run(sandboxed(["true"], workdir, sandbox), capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ToolError(f"explorer.python_sandbox: bwrap does not run here ({e}): {fix}") from None
    if probe.returncode != 0:
        raise ToolError(f"explorer.python_sandbox: bwrap cannot create its sandbox here "
                        f"({probe.stderr.strip()[:300] or f'exit status {probe.returncode}'}): {fix}")


def run_python(code: str, limits: ToolLimits) -> str:
    """Run `code` under the sandbox above; the text the model sees."""
    processes = _process_limit(limits)
    with tempfile.TemporaryDirectory(prefix="rft-python-tool-") as workdir:
        if limits.sandbox != "none" and os.geteuid() == 0:
            os.chown(workdir, SANDBOX_UID, SANDBOX_UID)  # the code runs as nobody: its one writable directory
        out_path = os.path.join(workdir, "output")
        with open(out_path, "wb") as out:
            try:
                process = subprocess.Popen(
                    sandboxed([sys.executable, "-I", "-"], workdir, limits.sandbox), stdin=subprocess.PIPE,
                    stdout=out, stderr=subprocess.STDOUT, cwd=workdir, env=TOOL_ENVIRONMENT,
                    start_new_session=True,
                    preexec_fn=lambda: _limit(_cpu_seconds(limits), limits.memory_mb << 20, processes))
            except OSError as e:  # the sandbox (bwrap) or the interpreter could not be started
                # (what the program prints is never read as the sandbox's failure: a program could fake it to
                # leave its own episode out of training)
                raise SandboxError(f"python: the sandbox could not start ({e})") from None
            try:
                process.communicate(code.encode("utf-8", "replace"), timeout=limits.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                signal_group(process, signal.SIGKILL)  # the program and anything it started
                process.wait()
        with open(out_path, "rb") as f:
            output = f.read(MAX_FILE_BYTES).decode("utf-8", "replace")
    if len(output.encode()) >= MAX_FILE_BYTES:
        return f"error: output over {MAX_FILE_BYTES} bytes\n{_tail(output, limits)}"
    if timed_out:
        return f"error: timed out after {limits.timeout_s:g} s" + (f"\n{_tail(output, limits)}" if output else "")
    if process.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and not timed_out:
        return f"error: CPU time limit ({_cpu_seconds(limits)} s) exceeded"
    if process.returncode != 0:
        status = (f"killed by {signal.Signals(-process.returncode).name}" if process.returncode < 0
                  else f"exit status {process.returncode}")
        return f"error: {status}" + (f"\n{_tail(output, limits)}" if output else "")
    return output or "(no output)"  # ToolBox.run truncates it to output_chars


def _cpu_seconds(limits: ToolLimits) -> int:
    """The CPU-time limit: one second above the wall-clock limit, so a busy loop times out on the wall clock first."""
    return math.ceil(limits.timeout_s) + 1


def _tail(output: str, limits: ToolLimits) -> str:
    """At most `output_chars // 2` characters from the end (a traceback's useful end), leaving room for the status."""
    keep = limits.output_chars // 2
    return output if len(output) <= keep else "..." + output[-keep:]


@register_tool("python")
class Python:
    schema = function_schema("python", "Run a Python program and return what it prints (stdout and stderr). "
                             "Use print() to see values.", code="the program, e.g. print(sum(range(10)))")

    def __init__(self, limits: ToolLimits):
        check_sandbox(limits.sandbox)  # refuse now, loudly, rather than answer every call with an error
        self.limits = limits

    def __call__(self, arguments: dict[str, Any]) -> str:
        (code,) = require_arguments(arguments, "python", code=str)
        return run_python(code, self.limits)
