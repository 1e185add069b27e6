"""The OpenAI chat-completions request fields both of rft's OpenAI-compatible endpoints check the same way (`rft
serve`, rft/serve/requests.py; the explorer's recording endpoint for agent programs, rft/workflows/endpoint.py), and
`ApiError`, the OpenAI-style refusal they raise (`{"error": {"message", "type", "param", "code"}}` with its HTTP
status).

Contract: every reader raises ApiError 400 naming the bad field (`param`) and never trusts a value beyond its type and
range. Standard library only: no web framework, no engine.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

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


def text_content(content: Any, where: str) -> str:
    """A message's content: a string, None (empty) or a list of text parts; ApiError naming `where` otherwise."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}: content must be a string or a list of text parts", param=where)


def number_field(body: dict, key: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{key}: expected a number, got {json.dumps(value)[:40]}", param=key)
    if value < low or (low_open and value == low) or value > high:
        raise ApiError(400, f"{key}: {value} is out of range ({'(' if low_open else '['}{low}, {high}])", param=key)
    return float(value)


def integer_field(body: dict, key: str, default: int, low: int, high: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{key}: expected an integer, got {json.dumps(value)[:40]}", param=key)
    if not low <= value <= high:
        raise ApiError(400, f"{key}: {value} is out of range [{low}, {high}]", param=key)
    return value


@dataclass(frozen=True)
class SamplingFields:
    """A request's sampling fields, checked: `max_tokens` None when the request does not set it."""
    n: int
    temperature: float
    top_p: float
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool


def sampling_fields(body: dict, *, max_tokens: int, max_n: int, temperature: float = 1.0,
                    top_p: float = 1.0) -> SamplingFields:
    """n (1..max_n), temperature [0, 2], top_p (0, 1] (defaults: the arguments), max_tokens or max_completion_tokens
    (1..`max_tokens`, the model's limit, model.max_response_len), stop (a string or up to MAX_STOP), stream."""
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
    return SamplingFields(n=integer_field(body, "n", 1, 1, max_n),
                          temperature=number_field(body, "temperature", temperature, 0.0, 2.0),
                          top_p=number_field(body, "top_p", top_p, 0.0, 1.0, low_open=True),
                          max_tokens=limit, stop=tuple(stops), stream=stream)


async def json_body(request: Any, limit: int, setting: str) -> Any:
    """A Starlette request's body parsed as JSON: ApiError 413 past `limit` bytes (the config key `setting`; read no
    further than that), 400 if it is not JSON."""
    too_long = ApiError(413, f"the request body is over {setting} = {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_long
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_long
    try:
        return json.loads(body)
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
