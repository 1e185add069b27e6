"""The tool registry, tool-call parsing and the call runner of the `tool_agent` workflow.

A tool is a class registered by name (`@register_tool`; `explorer.tools` lists the names, or import paths
`package.module:Class`), built once per workflow as `cls(limits: ToolLimits)`. It has a `schema` (the OpenAI
function schema `{"type": "function", "function": {"name", "description", "parameters"}}` that chat templates
render into the prompt) and `__call__(arguments: dict) -> str` returning the text the model sees, raising
`ToolError` for a call that cannot be answered.

Recognised tool-call format (Hermes / Qwen2.5, what their chat templates ask for): one or more blocks
`<tool_call>{"name": NAME, "arguments": {...}}</tool_call>` in the model's turn (whitespace around the JSON allowed;
`arguments` may also be a string holding a JSON object, as OpenAI's API writes it). Text outside the blocks is
ignored. A turn without `<tool_call>` is the final answer.

Invariant: `run_calls` never raises for anything the model wrote. An unclosed block, JSON that does not parse, a
missing name, an unknown tool, bad arguments, a timeout or an exception inside the tool become one result string
starting with `error:`, which goes back to the model as that call's tool message.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rft.registry import Registry

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)


class ToolError(ValueError):
    """A tool call that cannot be answered (its message goes to the model, after `error: `); also an unknown tool
    name in `explorer.tools` (the message names the key)."""


class SandboxError(ToolError):
    """The sandbox refused to run a call (it could not be set up: not the model's fault): `ToolBox.run` raises it
    instead of answering, and the tool_agent episode is a failed rollout of class `sandbox`."""


@dataclass(frozen=True)
class ToolLimits:
    """Limits every tool call runs under: `timeout_s` wall seconds (the python tool also gets that much CPU time),
    `memory_mb` address space of a sandboxed process, `output_chars` characters of a result the model sees;
    the python tool's `sandbox` ("bwrap" or "none", explorer.python_sandbox), `max_processes` (processes and
    threads it may run at once, explorer.tool_max_processes) and `workdir_mb` (the size of its sandbox's /tmp,
    explorer.python_workdir_mb)."""
    timeout_s: float = 5.0
    memory_mb: int = 512
    output_chars: int = 1000
    sandbox: str = "bwrap"
    max_processes: int = 16
    workdir_mb: int = 64


class Tool(Protocol):
    schema: dict[str, Any]

    def __call__(self, arguments: dict[str, Any]) -> str: ...


TOOLS: Registry[Any] = Registry("tool", noun="tool", error=ToolError)
register_tool = TOOLS.register  # class decorator: a name in `explorer.tools`


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `name` and `arguments`, or `error` (why the block could not be read as a call)."""
    name: str = ""
    arguments: dict[str, Any] | None = None
    error: str = ""


def has_tool_call(text: str) -> bool:
    return CALL_OPEN in text


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` block of `text`, in order (an unclosed last block runs to the end of the text)."""
    calls = []
    for match in _BLOCK.finditer(text):
        closed = match.group(0).endswith(CALL_CLOSE)
        calls.append(_parse_block(match.group(1).strip(), closed))
    return calls


def _parse_block(body: str, closed: bool) -> ToolCall:
    if not closed:
        return ToolCall(error=f"unparseable tool call: {CALL_OPEN} without {CALL_CLOSE}")
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(error=f"unparseable tool call: {e.msg} at character {e.pos} of {body[:80]!r}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error='unparseable tool call: expected {"name": "...", "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(call["name"], error=f"unparseable tool call arguments: {e.msg}")
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error="tool call arguments must be a JSON object")
    return ToolCall(call["name"], arguments)


class ToolBox:
    """The tools of a run (`explorer.tools`), built once; `run_calls` answers a model turn's calls."""

    def __init__(self, names: Sequence[str], limits: ToolLimits, *, key: str = "explorer.tools"):
        if not names:
            raise ToolError(f"{key}: must name at least one tool (registered: {', '.join(sorted(TOOLS))})")
        self.tools: dict[str, Tool] = {}
        for name in names:
            tool = TOOLS.resolve(name, key=key)(limits)
            self.tools[tool.schema["function"]["name"]] = tool
        self.limits = limits

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def run(self, call: ToolCall) -> str:
        """The result text of one call: the tool's answer (truncated to `limits.output_chars`), or `error: ...`;
        SandboxError when the sandbox refused to run it."""
        if call.error:
            return f"error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r} (tools: {', '.join(self.tools)})"
        try:
            result = tool(call.arguments or {})
        except SandboxError:
            raise
        except ToolError as e:
            return f"error: {e}"
        except Exception as e:  # a tool's own bug must not end the episode, let alone the explorer
            return f"error: {call.name} failed: {type(e).__name__}: {e}"
        return truncate(result, self.limits.output_chars)

    def run_calls(self, text: str) -> list[tuple[ToolCall, str]]:
        """Each call of a model turn with its result, in order (empty: the turn has no tool call)."""
        return [(call, self.run(call)) for call in parse_tool_calls(text)]


def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [truncated, {len(text)} characters]"


def require_arguments(arguments: dict[str, Any], tool: str, **types: type) -> list[Any]:
    """The named arguments, checked for presence and type; ToolError naming the tool and argument otherwise."""
    values = []
    for name, kind in types.items():
        if name not in arguments:
            raise ToolError(f"{tool}: missing argument {name!r}")
        if not isinstance(arguments[name], kind):
            raise ToolError(f"{tool}: argument {name!r} must be a {kind.__name__}, "
                            f"got {type(arguments[name]).__name__}")
        values.append(arguments[name])
    unknown = sorted(set(arguments) - set(types))
    if unknown:
        raise ToolError(f"{tool}: unknown argument(s) {', '.join(map(repr, unknown))}")
    return values


def function_schema(name: str, description: str, **parameters: str) -> dict[str, Any]:
    """An OpenAI function schema with required string parameters (name -> description)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": list(parameters),
                       "properties": {p: {"type": "string", "description": d} for p, d in parameters.items()}}}}
