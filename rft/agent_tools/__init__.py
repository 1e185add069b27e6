"""Tools for the `tool_agent` workflow: the registry, call parsing and the runner (`rft.agent_tools.registry`), and the
built-in tools `calculator` (an `ast` arithmetic evaluator) and `python` (a sandboxed subprocess). Importing
this package registers the built-ins."""
from __future__ import annotations

from rft.agent_tools import calculator, python  # noqa: F401  (registers the built-ins)
from rft.agent_tools.registry import (
    TOOLS,
    SandboxError,
    ToolBox,
    ToolCall,
    ToolError,
    ToolLimits,
    has_tool_call,
    parse_tool_calls,
    register_tool,
)

__all__ = ["TOOLS", "SandboxError", "ToolBox", "ToolCall", "ToolError", "ToolLimits", "has_tool_call",
           "parse_tool_calls", "register_tool"]
