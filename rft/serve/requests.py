"""What `rft serve` accepts: a chat completion request checked field by field (`parse_chat_request`), its messages
rendered to prompt ids (`renderer`), and `ApiError` (rft/text/openai_api.py, with the fields both of rft's
OpenAI-compatible endpoints check), the OpenAI-style refusal every serve module raises.

Contracts:
- A request is refused with 400 naming the bad field (messages, n, temperature, top_p, max_tokens or
  max_completion_tokens up to model.max_response_len, stop, stream), 404 for a model not served (`serve.model_name`,
  else run.name, then each `serve.adapters` name).
- Image content parts (`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`, in user
  messages) are taken for a vision-language model only (`ImageLimits`: serve.max_images, max_image_bytes,
  max_image_pixels; png, jpeg, webp data URIs); a remote URL is refused (no network fetches), and so is a wrong
  media type, bad base64, too many or too large images, or bytes that are not the declared format: 400 naming the
  part. An image prompt is checked whole against model.max_prompt_len after the processor expanded its images
  (rft.models.vision), never cut.
- Messages are rendered as the explorers render prompts: with `model.chat_template: true` by the tokenizer's chat
  template (the whole conversation, `model.system_prompt` first when set and the request has no system message;
  rft/text/chat.py), else the messages' contents joined by newlines as plain text with the tokenizer's special
  tokens. A prompt over model.max_prompt_len is 400 (`context_length_exceeded`).
Standard library, numpy and the engine's sampling settings only: no web framework.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rft.engine import ImagePrompt, SamplingSettings
from rft.models.vision import (
    MEDIA_TYPES,
    VisionError,
    as_pil,
    placeholder,
    process_prompt,
    prompt_length_problem,
    render_chat,
)
from rft.text.chat import ChatError, encode_messages
from rft.text.openai_api import ApiError, sampling_fields, text_content

if TYPE_CHECKING:
    from rft.models.config import ModelConfig
    from rft.serve.config import ServeConfig

MAX_N = 16
DATA_URI = re.compile(r"data:([A-Za-z0-9.+/-]+);base64,(.*)", re.DOTALL)


@dataclass(frozen=True)
class ImageLimits:
    """The image parts one request may carry: `max_images` (0: none, a text model), each at most `max_image_bytes`
    decoded and `max_image_pixels` (width x height, checked from its header before its pixels are decoded)."""
    max_images: int = 0
    max_image_bytes: int = 1 << 20
    max_image_pixels: int = 2048 * 2048

    @classmethod
    def of(cls, serve: ServeConfig, *, vision: bool) -> ImageLimits:
        """serve.max_images (for a vision-language model; a text model takes none), max_image_bytes, pixels."""
        return cls(serve.max_images if vision else 0, serve.max_image_bytes, serve.max_image_pixels)


@dataclass(frozen=True)
class ChatRequest:
    # content: a string; in a request with images every content is a list of {"type": "text", "text"} and
    # {"type": "image"} parts (the images in `images`, in order), as a processor's chat template takes them
    messages: list[dict[str, Any]]
    sampling: SamplingSettings
    stream: bool
    adapter: str | None = None  # the `serve.adapters` model the request names; None: the run's own policy
    images: tuple[tuple[bytes, str], ...] = ()  # (encoded bytes, media type) of each image part, in order


def image_bytes(part: dict, where: str, limits: ImageLimits) -> tuple[bytes, str]:
    """An `image_url` part's image as (bytes, media type): a base64 data URI of png, jpeg or webp within
    `limits.max_image_bytes`; ApiError 400 naming `where` otherwise (remote URLs are never fetched)."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str):
        raise ApiError(400, f"{where}.image_url: expected {{\"url\": \"data:image/png;base64,...\"}}", param=where)
    if re.match(r"(?i)[a-z][a-z0-9+.-]*://", url):
        raise ApiError(400, f"{where}.image_url: remote image URLs are not fetched (this server makes no network "
                       "requests); send the image inline as a data URI (data:image/png;base64,...)", param=where)
    match = DATA_URI.fullmatch(url)
    if match is None:
        raise ApiError(400, f"{where}.image_url: not a base64 data URI (data:<media type>;base64,<data>)",
                       param=where)
    media_type, encoded = match[1].lower(), match[2]
    if media_type not in MEDIA_TYPES:
        raise ApiError(400, f"{where}.image_url: media type {media_type!r} is not accepted "
                       f"({', '.join(MEDIA_TYPES)})", param=where)
    if len(encoded) // 4 * 3 > limits.max_image_bytes + 3:  # refused before decoding
        raise ApiError(400, f"{where}: the image is over serve.max_image_bytes = {limits.max_image_bytes} bytes",
                       param=where)
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}.image_url: the data URI's base64 does not decode", param=where) from None
    if not data or len(data) > limits.max_image_bytes:
        raise ApiError(400, f"{where}: the image is {len(data)} bytes; 1 to serve.max_image_bytes = "
                       f"{limits.max_image_bytes} are accepted", param=where)
    return data, media_type


def content_parts(content: Any, where: str, role: str, limits: ImageLimits,
                  images: list[tuple[bytes, str]]) -> list[dict[str, str]] | None:
    """A message's content with image parts as `[{"type": "text", "text"}, {"type": "image"}]` (their images
    appended to `images`), or None when it has no image part (`text_content` reads it). ApiError 400 for an image
    part this request may not carry."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "image_url"
                                                for p in content):
        return None
    parts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in ("text", "image_url"):
            raise ApiError(400, f"{at}: a content part must be text or image_url", param=at)
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"{at}.text: expected a string", param=at)
            parts.append({"type": "text", "text": part["text"]})
            continue
        if limits.max_images == 0:
            raise ApiError(400, f"{at}: this model takes no images (not a vision-language model)", param=at)
        if role != "user":
            raise ApiError(400, f"{at}: image parts are taken in user messages only", param=at)
        if len(images) >= limits.max_images:
            raise ApiError(400, f"{at}: more than serve.max_images = {limits.max_images} images in one request",
                           param=at)
        images.append(image_bytes(part, at, limits))
        parts.append({"type": "image"})
    return parts


def parse_chat_request(body: Any, *, model_name: str, max_tokens: int, adapters: tuple[str, ...] = (),
                       images: ImageLimits = ImageLimits()) -> ChatRequest:
    """The request as rft runs it; ApiError (400, or 404 for another model) naming the bad field. `max_tokens`: the
    largest (and default) completion length, model.max_response_len. `adapters`: the other model names served
    (serve.adapters). `images`: the image parts a request may carry (none by default: a text model)."""
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
    rendered: list[dict[str, Any]] = []
    found: list[tuple[bytes, str]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"{where}: expected an object with a string role", param=where)
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"{where}.role: unknown role {m['role']!r}", param=f"{where}.role")
        parts = content_parts(m.get("content"), f"{where}.content", m["role"], images, found)
        rendered.append({"role": "system" if m["role"] == "developer" else m["role"],
                         "content": parts if parts is not None else text_content(m.get("content"),
                                                                                 f"{where}.content")})
    if found:  # every content as parts, as a processor's chat template takes them
        rendered = [m if isinstance(m["content"], list) else {**m, "content": [{"type": "text", "text": m["content"]}]}
                    for m in rendered]
        if model in adapters:
            raise ApiError(400, "messages: image parts are served by the run's own model, not by an adapter",
                           param="messages")
    f = sampling_fields(body, max_tokens=max_tokens, max_n=MAX_N)
    sampling = SamplingSettings(n=f.n, temperature=f.temperature, top_p=f.top_p, max_tokens=f.max_tokens or max_tokens,
                                stop=f.stop)
    return ChatRequest(rendered, sampling, f.stream, adapter=model if model in adapters else None,
                       images=tuple(found))


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


def image_renderer(model: ModelConfig, processor: Any, max_pixels: int) -> Callable[[list, tuple], ImagePrompt]:
    """How a vision-language model's request (messages with image parts, their images) becomes an `ImagePrompt`:
    with `model.chat_template: true` the processor's chat template (`model.system_prompt` as for text), else each
    message's text with the processor's placeholder for each image, joined by newlines. The images are decoded here
    (within `max_pixels`) and the prompt expanded once by the processor (rft.models.vision.process_prompt) to refuse
    it whole over model.max_prompt_len; 400 naming the problem."""

    def render(messages: list[dict[str, Any]], images: tuple) -> ImagePrompt:
        try:
            pils = tuple(as_pil(image, max_pixels=max_pixels) for image in images)
        except VisionError as e:
            raise ApiError(400, f"messages: an image is refused: {e}", param="messages") from None
        if model.chat_template:
            if model.system_prompt and not any(m["role"] == "system" for m in messages):
                messages = [{"role": "system", "content": [{"type": "text", "text": model.system_prompt}]}] + messages
            try:
                text = render_chat(processor, messages)
            except VisionError as e:
                raise ApiError(500, str(e), kind="server_error") from None
        else:
            mark = placeholder(processor)
            text = "\n".join("".join(p["text"] if p["type"] == "text" else mark for p in m["content"])
                              if isinstance(m["content"], list) else m["content"] for m in messages)
        try:
            processed = process_prompt(processor, text, pils)
        except VisionError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
        problem = prompt_length_problem(processed, model.max_prompt_len)
        if problem is not None:
            raise ApiError(400, f"messages: {problem}", param="messages", code="context_length_exceeded")
        return ImagePrompt(text, pils, processed)
    return render
