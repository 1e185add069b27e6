"""The tools' keys of the `explorer` section (tool_agent): which tools, and the python tool's limits and sandbox."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rft.config import COUNT, POSITIVE, Range, Section, at_least, option


@dataclass(frozen=True)
class ToolOptions(Section):
    """Which tools a tool_agent episode offers, and the limits every tool call has."""
    KEY = "explorer"
    tools: list[str] = option(factory=lambda: ["calculator", "python"],
        help="tool_agent: registered tool names or package.module:Class")
    tool_timeout_s: float = option(5.0, range=POSITIVE,
        help="tool_agent: wall-clock limit of one tool call (the python tool: also its CPU seconds)")
    tool_output_chars: int = option(1000, range=COUNT,
        help="tool_agent: characters of a tool result the model sees (the rest is cut)")


@dataclass(frozen=True)
class PythonToolOptions(Section):
    """The python tool's isolation and limits (rft/agent_tools/python.py)."""
    KEY = "explorer"
    python_sandbox: Literal["bwrap", "none"] = option("bwrap",
        help="tool_agent: how the python tool is isolated. bwrap (bubblewrap, `make system-deps`): no network, no "
        "other processes in view, a read-only root of /usr and the interpreter only (no home, run directory or "
        "host socket), a private /tmp and /dev/shm of python_workdir_mb each its only writable places, the whole "
        "process tree killed after the call; an explorer refuses to start when it cannot work here. none: no "
        "isolation (trusted code only; the same limits). Equal in every run of one explorer (docs/security.md)")
    tool_memory_mb: int = option(512, range=at_least(64),
        help="tool_agent: address-space limit of each process of the python tool")
    tool_max_processes: int = option(16, range=COUNT,
        help="tool_agent: processes and threads the python tool's code may run at once")
    python_workdir_mb: int = option(64, range=Range(1, 4096),
        help="tool_agent: size of the python tool's private /tmp, and of its /dev/shm, in the bwrap sandbox "
        "(each a tmpfs: memory): the most it can write there")
