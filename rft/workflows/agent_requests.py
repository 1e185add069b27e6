"""What the recording endpoint (rft/workflows/endpoint.py, whose docstring states the contract) accepts: its
settings, its episodes, a chat-completions request checked field by field (`parse_agent_request`), and the calls its
HTTP face (rft/workflows/endpoint_http.py) makes into it (`EndpointCalls`)."""
from __future__ import annotations

import concurrent.futures
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rft.text.openai_api import ApiError, SamplingFields, sampling_fields, text_content
from rft.workflows.recording import RecordedCall

if TYPE_CHECKING:
    from rft.explorer.config import ExplorerConfig
    from rft.models.config import ModelConfig

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 1024
MAX_TOOLS = 128
MAX_TOOL_CALLS = 64


@dataclass(frozen=True)
class EndpointSettings:
    """What the endpoint serves: the model name, the prompt and response limits of a sample (model.max_prompt_len,
    max_response_len), the default system prompt, the default sampling (explorer.temperature, top_p), how many calls
    one episode may make, how long a call may wait, the largest request body, how many calls one engine call takes."""
    model_name: str = "rft-policy"
    max_prompt_len: int = 1024
    max_response_len: int = 1024
    system_prompt: str = ""
    temperature: float = 1.0
    top_p: float = 1.0
    max_calls: int = 64
    request_timeout_s: float = 300.0
    max_body_bytes: int = 8 << 20
    max_batch: int = 64

    @classmethod
    def of(cls, explorer: ExplorerConfig, model: ModelConfig, **overrides: Any) -> EndpointSettings:
        return cls(model_name=model.path.rstrip("/").rsplit("/", 1)[-1] or "rft-policy",
                   max_prompt_len=model.max_prompt_len, max_response_len=model.max_response_len,
                   system_prompt=model.system_prompt, temperature=explorer.temperature, top_p=explorer.top_p,
                   **overrides)


@dataclass
class Episode:
    """One client's calls: `key` (its API key), `calls` recorded in order. Closed: its calls are refused (410)."""
    key: str
    calls: list[RecordedCall] = field(default_factory=list)
    root_lens: list[int] = field(default_factory=list)  # per call: its root call's prompt length
    closed: bool = False


@dataclass(frozen=True)
class AgentRequest:
    """A checked chat-completions request: `messages` as the chat template takes them (assistant `tool_calls` with
    arguments as objects; tool messages `{"role": "tool", "name"?, "content"}`), `tools` (function schemas),
    `tools_key` (their canonical JSON), the sampling fields, and whether log-probs are asked for."""
    messages: list[dict[str, Any]]
    tools: tuple[dict[str, Any], ...]
    tools_key: str
    sampling: SamplingFields
    logprobs: bool


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            raise ApiError(400, f"{where}: arguments is not JSON", param=where) from None
    if not isinstance(raw, dict):
        raise ApiError(400, f"{where}: arguments must be a JSON object", param=where)
    return raw


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or len(raw) > MAX_TOOL_CALLS:
        raise ApiError(400, f"{where}: a list of at most {MAX_TOOL_CALLS} tool calls", param=where)
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"{where}[{j}]: expected {{\"type\": \"function\", \"function\": {{\"name\", "
                           "\"arguments\"}}", param=f"{where}[{j}]")
        calls.append({"type": "function", "function": {
            "name": function["name"], "arguments": _arguments(function.get("arguments"), f"{where}[{j}]")}})
    return calls


def _message(m: Any, where: str) -> dict[str, Any]:
    """One request message in the chat template's form (module docstring); ApiError naming the field."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ApiError(400, f"{where}: expected an object whose role is one of {', '.join(ROLES)}", param=where)
    role = "system" if m["role"] == "developer" else m["role"]
    out: dict[str, Any] = {"role": role, "content": text_content(m.get("content"), f"{where}.content")}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    if role == "tool" and isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _tools(raw: Any) -> tuple[dict[str, Any], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise ApiError(400, f"tools: a list of at most {MAX_TOOLS} function schemas", param="tools")
    for j, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function" \
                or not isinstance(function.get("name"), str):
            raise ApiError(400, f"tools[{j}]: expected {{\"type\": \"function\", \"function\": {{\"name\", "
                           "\"description\", \"parameters\"}}", param=f"tools[{j}]")
    return tuple(raw)


def parse_agent_request(body: Any, settings: EndpointSettings) -> AgentRequest:
    """The request as the endpoint runs it (module docstring); ApiError 400 naming the bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw or len(raw) > MAX_MESSAGES:
        raise ApiError(400, f"messages: required, a list of 1 to {MAX_MESSAGES} messages", param="messages")
    messages = [_message(m, f"messages[{i}]") for i, m in enumerate(raw)]
    if settings.system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": settings.system_prompt})
    tools = _tools(body.get("tools"))
    fields = sampling_fields(body, max_tokens=settings.max_response_len, max_n=1, temperature=settings.temperature,
                             top_p=settings.top_p)
    if fields.stream:
        raise ApiError(400, "stream: not supported by the recording endpoint; send stream: false", param="stream")
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise ApiError(400, "logprobs: expected true or false", param="logprobs")
    return AgentRequest(messages, tools, json.dumps(tools, sort_keys=True), fields, logprobs)


class EndpointCalls(Protocol):
    """What the HTTP face calls: the settings, when it started, the episode a key names (ApiError 401 for none), and
    `submit` (a future of the response body or an ApiError)."""
    settings: EndpointSettings
    started: int

    def episode(self, key: str | None) -> Episode: ...

    def submit(self, episode: Episode, request: AgentRequest) -> concurrent.futures.Future: ...
