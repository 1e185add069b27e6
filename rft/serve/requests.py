"""What `rft serve` accepts: a chat completion request checked field by field (`parse_chat_request`), its messages
rendered to prompt ids (`renderer`), and `ApiError` (rft/text/openai_api.py, with the fields both of rft's
OpenAI-compatible endpoints check), the OpenAI-style refusal every serve module raises.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rft.engine import SamplingSettings
from rft.text.chat import ChatError, encode_messages
from rft.text.openai_api import ApiError, sampling_fields, text_content

if TYPE_CHECKING:
    from rft.models.config import ModelConfig

MAX_N = 16


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    sampling: SamplingSettings
    stream: bool
    adapter: str | None = None  # the `serve.adapters` model the request names; None: the run's own policy


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
                         "content": text_content(m.get("content"), f"{where}.content")})
    f = sampling_fields(body, max_tokens=max_tokens, max_n=MAX_N)
    sampling = SamplingSettings(n=f.n, temperature=f.temperature, top_p=f.top_p, max_tokens=f.max_tokens or max_tokens,
                                stop=f.stop)
    return ChatRequest(rendered, sampling, f.stream, adapter=model if model in adapters else None)


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
