"""`python`: a snippet of Python run in a sandboxed subprocess; the answer is what it printed.

The process: this interpreter (`sys.executable`, named through its directory's real path) `-I` (isolated: no
PYTHON* variables, no user site, the script's directory not on the path) reading the code from stdin, in a new
session, with an environment of its own (TOOL_ENVIRONMENT: no proxies, no credentials, no PYTHONPATH, no HOME), under
`ProcessLimits` set by prlimit before exec (rft/agent_tools/sandbox.py): CPU time `ceil(timeout_s) + 1` seconds,
address space `memory_mb` per process, files written at most 1 MiB each, 256 open files, no core files, and in the
sandbox `max_processes`. The wall-clock limit is `timeout_s`; past it the whole process group is killed.

The output: stdout and stderr go to one anonymous in-memory file (memfd) that the explorer creates and keeps open;
the explorer reads it back through its own descriptor, never by a path (the code cannot swap it for a symlink, a
FIFO, a directory or a hard link), at most 1 MiB (the file-size limit stops the code there), and the model sees at
most `output_chars` characters of it.

The sandbox (`ToolLimits.sandbox`, explorer.python_sandbox): `bwrap` runs the code in `sandboxed`'s sandbox
(rft/agent_tools/sandbox.py: no network, its own /proc, a root of /usr, the loader's configuration and, read-only,
this interpreter's prefixes: the venv's and its base installation's; a private /tmp of `workdir_mb` as its cwd;
everything it started dies with the call). When the explorer runs as root the code runs as a user of its own
(a fresh uid per call), which also makes the process limit hold (RLIMIT_NPROC does not bind root): `max_processes`
tasks of this call at once; otherwise bwrap maps the user in a new user namespace and the limit is the user's tasks
now plus `max_processes`.
`check_sandbox` refuses, with what to do, when the sandbox cannot work here (not installed, or namespaces not
allowed); `none` runs with the same limits and output file, in a fresh temporary directory of the host, without
isolation (trusted code only).

Results: the output (`(no output)` when nothing was printed); on a non-zero exit `error: exit status N` and the
output's last lines (the traceback); on a timeout `error: timed out after X s`. Never raises for the model's code.
No seccomp filter and no cgroup: a kernel exploit is out of scope; the namespaces bound what the code can see and
reach, the limits what one call can take (docs/security.md).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from rft.agent_tools.registry import (
    SandboxError,
    ToolError,
    ToolLimits,
    function_schema,
    register_tool,
    require_arguments,
)
from rft.agent_tools.sandbox import (
    MAX_FILE_BYTES,
    ProcessLimits,
    SandboxUnavailable,
    check_bwrap,
    limited,
    require_tools,
    sandboxed,
)
from rft.processes import signal_group

# The code's whole environment: nothing inherited; one thread per math library (a BLAS that starts a thread per core
# of a large machine would run into the process limit)
TOOL_ENVIRONMENT = {"PYTHONIOENCODING": "utf-8", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
                    "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
FIX = ("install bubblewrap (`make system-deps`, or apt-get install bubblewrap) and allow it namespaces (a "
       "container may need --security-opt seccomp=unconfined or unprivileged user namespaces), or set "
       "explorer.python_sandbox: none to run the python tool's code without isolation (trusted code only)")


def interpreter() -> str:
    """This interpreter by its directory's real path (a venv's `bin/python` keeps its name: the venv is found
    beside it), so that it is the same path inside the sandbox, which binds only real paths."""
    return os.path.join(os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable))


def interpreter_paths() -> list[str]:
    """The directories the interpreter needs, read-only in the sandbox: its prefixes (a venv's and its base
    installation's) and the directory of the real executable."""
    return [os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
                                         os.path.dirname(os.path.realpath(sys.executable)))]


def python_command(limits: ToolLimits, *arguments: str) -> list[str]:
    """The argv running the interpreter with `arguments` under `limits` (its sandbox, process limits)."""
    command = [interpreter(), "-I", *arguments]
    process_limits = ProcessLimits(_cpu_seconds(limits), limits.memory_mb << 20, process_limit(limits))
    if limits.sandbox == "none":
        return limited(command, process_limits)
    return sandboxed(command, process_limits, workdir_bytes=limits.workdir_mb << 20, ro_paths=interpreter_paths())


def process_limit(limits: ToolLimits) -> int | None:
    """RLIMIT_NPROC for the sandboxed code (counted per user, threads included): `max_processes` for the call's own
    user when the explorer is root; else the user's tasks now plus `max_processes`. None without a sandbox."""
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
    """ToolError (naming explorer.python_sandbox and what to do) unless `sandbox` works on this machine: prlimit is
    installed, and for bwrap bwrap and setpriv too and the interpreter starts in the sandbox (tried once per
    process)."""
    if sandbox == "none":
        try:
            require_tools(["prlimit"])
        except SandboxUnavailable as e:
            raise ToolError(f"explorer.python_sandbox: none: {e}: the python tool sets its limits with it") from None
        return
    try:
        require_tools()
        check_bwrap(python_command(ToolLimits(timeout_s=30.0, sandbox=sandbox), "-c", ""))
    except SandboxUnavailable as e:
        raise ToolError(f"explorer.python_sandbox: {e}: {FIX}") from None


@contextlib.contextmanager
def _workdir(limits: ToolLimits) -> Iterator[str]:
    """The host directory the process starts in: a fresh temporary one without the sandbox (its cwd), / with it
    (bwrap changes into the sandbox's own /tmp)."""
    if limits.sandbox != "none":
        yield "/"
        return
    with tempfile.TemporaryDirectory(prefix="rft-python-tool-") as workdir:
        yield workdir


def run_python(code: str, limits: ToolLimits) -> str:
    """Run `code` under the sandbox above; the text the model sees."""
    command = python_command(limits, "-")
    output_fd = os.memfd_create("rft-python-output", os.MFD_CLOEXEC)  # no path: nothing can take its place
    try:
        with _workdir(limits) as cwd:
            try:
                process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=output_fd, stderr=subprocess.STDOUT,
                                           cwd=cwd, env=TOOL_ENVIRONMENT, start_new_session=True)
            except OSError as e:  # the sandbox (bwrap, prlimit) or the interpreter could not be started
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
        written = os.pread(output_fd, MAX_FILE_BYTES, 0)
    finally:
        os.close(output_fd)
    output = written.decode("utf-8", "replace")
    if len(written) >= MAX_FILE_BYTES:
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
