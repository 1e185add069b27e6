"""`python`: a snippet of Python run in a sandboxed subprocess; the answer is what it printed.

The sandbox: `sys.executable -I` (isolated: no PYTHON* variables, no user site, the script's directory not on
the path) reading the code from stdin, in a new session, with an empty environment (no proxies, no credentials,
no PYTHONPATH), cwd a fresh temporary directory, and `resource` limits set before exec: CPU time
`ceil(timeout_s) + 1` seconds, address space `memory_mb`, files written at most 1 MiB, no core files. The wall-clock
limit is `timeout_s`; past it the whole process group is killed. stdout and stderr go to one file in that
directory (never an unbounded pipe) and the model sees at most `output_chars` characters of it.

Results: the output (`(no output)` when nothing was printed); on a non-zero exit `error: exit status N` and the
output's last lines (the traceback); on a timeout `error: timed out after X s`. Never raises for the model's code.
Not a security boundary against a determined attacker (no seccomp, no network namespace): it bounds the damage a
policy's accidental code can do to an explorer.
"""
from __future__ import annotations

import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
from typing import Any

from rft.agent_tools.registry import ToolLimits, function_schema, register_tool, require_arguments
from rft.processes import signal_group

MAX_FILE_BYTES = 1 << 20


def _limit(cpu_s: int, memory_bytes: int) -> None:
    """Runs in the child between fork and exec."""
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU at the soft limit, SIGKILL at the hard
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(code: str, limits: ToolLimits) -> str:
    """Run `code` under the sandbox above; the text the model sees."""
    with tempfile.TemporaryDirectory(prefix="rft-python-tool-") as workdir:
        out_path = os.path.join(workdir, "output")
        with open(out_path, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-I", "-"], stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                cwd=workdir, env={"PYTHONIOENCODING": "utf-8", "LC_ALL": "C.UTF-8"}, start_new_session=True,
                preexec_fn=lambda: _limit(_cpu_seconds(limits), limits.memory_mb << 20))
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
        self.limits = limits

    def __call__(self, arguments: dict[str, Any]) -> str:
        (code,) = require_arguments(arguments, "python", code=str)
        return run_python(code, self.limits)
