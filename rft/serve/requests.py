"""What `rft serve` accepts: a chat completion request checked field by field (`parse_chat_request`), its messages
rendered to prompt ids (`renderer`), and `ApiError`, the OpenAI-style refusal every serve module raises
(`{"error": {"message", "type", "param", "code"}}` with its HTTP status).

Contracts:
- A request is refused with 400 naming the bad field (messages, n, temperature, top_p, max_tokens or
  max_completion_tokens up to model.max_response_len, stop, stream), 404 for a model not served (`serve.model_name`,
  else run.name, then each `serve.adapters` name).
- Messages are rendered as the explorers render prompts: with `model.chat_template: true` by the tokenizer's chat
  template (the whole conversation, `model.system_prompt` first when set and the request has no system message;
  rft/text/chat.py), else the messages' contents joined by newlines as plain text with the tokenizer's special
  tokens. A prompt over model.max_prompt_len is 400 (`context_length_exceeded`).
Standard library, numpy and the engine's sampling settings only: no web framework.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rft.engine import SamplingSettings
from rft.text.chat import ChatError, encode_messages

if TYPE_CHECKING:
    from rft.models.config import ModelConfig

MAX_N = 16
MAX_STOP = 4


class ApiError(Exception):
    """A request refused with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    sampling: SamplingSettings
    stream: bool
    adapter: str | None = None  # the `serve.adapters` model the request names; None: the run's own policy


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}: content must be a string or a list of text parts", param=where)


def _number(body: dict, key: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{key}: expected a number, got {json.dumps(value)[:40]}", param=key)
    if value < low or (low_open and value == low) or value > high:
        raise ApiError(400, f"{key}: {value} is out of range ({'(' if low_open else '['}{low}, {high}])", param=key)
    return float(value)


def _integer(body: dict, key: str, default: int, low: int, high: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{key}: expected an integer, got {json.dumps(value)[:40]}", param=key)
    if not low <= value <= high:
        raise ApiError(400, f"{key}: {value} is out of range [{low}, {high}]", param=key)
    return value


def parse_chat_request(body: Any, *, model_name: str, max_tokens: int, adapters: tuple[str, ...] = ()) -> ChatRequest:
    """The request as rft runs it; ApiError (400, or 404 for another model) naming the bad field. `max_tokens`: the
    largest (and default) completion length, model.max_response_len. `adapters`: the other model names served
    (serve.adapters)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name and model not in adapters:
        served = ", ".join(repr(m) for m in (model_name, *adapters))
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served}", param="model",
                       code="model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: required, a non-empty list of {role, content} objects", param="messages")
    rendered = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"{where}: expected an object with a string role", param=where)
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"{where}.role: unknown role {m['role']!r}", param=f"{where}.role")
        rendered.append({"role": "system" if m["role"] == "developer" else m["role"],
                         "content": _text(m.get("content"), f"{where}.content")})
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ApiError(400, f"{key}: must be a positive integer, got {json.dumps(limit)[:40]}", param=key)
    if limit is not None and limit > max_tokens:
        raise ApiError(400, f"{key}: {limit} is over this model's limit of {max_tokens} tokens "
                       "(model.max_response_len)", param=key)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop: a string or a list of at most {MAX_STOP} non-empty strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream: expected true or false", param="stream")
    sampling = SamplingSettings(n=_integer(body, "n", 1, 1, MAX_N),
                                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                                max_tokens=limit or max_tokens, stop=tuple(stops))
    return ChatRequest(rendered, sampling, stream, adapter=model if model in adapters else None)


def prompt_key(prompt_tokens: list[int]) -> str:
    """The prompt's name for grouping: a hash of its token ids."""
    return hashlib.sha1(np.asarray(prompt_tokens, dtype="<i4").tobytes()).hexdigest()[:16]


def renderer(model: ModelConfig) -> Callable[[Any, list], list[int]]:
    """How messages become prompt ids (module docstring), refusing prompts over model.max_prompt_len."""

    def render(tokenizer, messages: list[dict[str, str]]) -> list[int]:
        if model.chat_template:
            if model.system_prompt and not any(m["role"] == "system" for m in messages):
                messages = [{"role": "system", "content": model.system_prompt}] + messages
            try:
                ids = encode_messages(tokenizer, messages)
            except ChatError as e:
                raise ApiError(500, str(e), kind="server_error") from None
        else:
            ids = list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])
        if not ids:
            raise ApiError(400, "messages: the prompt is empty after tokenization", param="messages")
        if len(ids) > model.max_prompt_len:
            raise ApiError(400, f"messages: the prompt is {len(ids)} tokens, over this model's limit of "
                           f"{model.max_prompt_len} (model.max_prompt_len)", param="messages",
                           code="context_length_exceeded")
        return ids
    return render
