"""The processor contract of vision-language models: how a prompt with images becomes the token ids the model sees.

A VLM's Hugging Face processor expands each image placeholder of a prompt (Idefics3's `<image>`, Qwen2.5-VL's
`<|image_pad|>`) into the image's tokens (how many depends on the image's size) and computes the pixel tensors. The
engine that generated a sample and the trainer that trains on it must agree on that expansion token for token; the
peers' most reported VLM bug is that they do not (double expansion, truncation inside an image). So:
- `process_prompt` is the one place rft runs a processor on a prompt: the expanded prompt ids and the pixel tensors.
- `prompt_mismatch` compares an engine's prompt ids (as the engine expanded them) with `process_prompt`'s: None, or
  the reason; `engine_prompt_problem` runs both for one sample (for the trainer to dead-letter the group;
  `reprocessed` is its first half, the processor's output or why it refuses).
- `prompt_length_problem`: a prompt over `model.max_prompt_len` is refused whole, never cut (a cut could fall inside
  an image's tokens).
- `decode_image`: encoded images (PNG, JPEG, WebP) are checked against their declared media type and a pixel limit
  before any pixel is decoded.
Images are PIL images or `(bytes, media_type)` pairs (the record's encoded form). Needs Pillow and transformers,
imported when called.
"""
from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# media type -> Pillow's format name; nothing else is decoded
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP"}
MAX_PIXELS = 4096 * 4096  # default decoded-size limit per image (Pillow's own bomb limit is ~89 M pixels)


class VisionError(ValueError):
    """A prompt or image the processor contract refuses; the message names what is wrong."""


def is_vision_model(path: str | os.PathLike) -> bool:
    """Whether the HF model directory at `path` is a vision-language model (its config has a `vision_config`)."""
    config = Path(path) / "config.json"
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def model_type(path: str | os.PathLike) -> str | None:
    """The `model_type` of the HF model directory at `path` (its config.json), None when unreadable."""
    try:
        value = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def load_processor(path: str | os.PathLike) -> Any:
    """The model's processor, none of it needing torchvision: for Qwen2.5-VL rft.models.qwen_vl's (transformers'
    processor without its torchvision-only video part), else transformers' `AutoProcessor` (for Idefics3 its PIL
    image processor)."""
    from rft.models import qwen_vl  # heavy: transformers

    if model_type(path) in qwen_vl.MODEL_TYPES:
        return qwen_vl.load(str(path))
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(path))


def decode_image(data: bytes, media_type: str, *, max_pixels: int = MAX_PIXELS) -> Any:
    """The RGB PIL image in `data`; VisionError if the media type is not png/jpeg/webp, the bytes are not that
    format, or it has over `max_pixels` pixels (checked from the header, before the pixels are decoded)."""
    from PIL import Image, UnidentifiedImageError

    expected = MEDIA_TYPES.get(media_type)
    if expected is None:
        raise VisionError(f"media type {media_type!r} is not accepted ({', '.join(MEDIA_TYPES)})")
    try:
        image = Image.open(io.BytesIO(data), formats=[expected])
    except Image.DecompressionBombError as e:  # Pillow's own limit, past twice its ~89 M pixels
        raise VisionError(f"the image is over the limit of {max_pixels} pixels ({e})") from None
    except (UnidentifiedImageError, OSError) as e:
        raise VisionError(f"the bytes are not a {media_type} image: {e}") from None
    width, height = image.size
    if width < 1 or height < 1 or width * height > max_pixels:
        raise VisionError(f"the image is {width}x{height} pixels, over the limit of {max_pixels} pixels")
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise VisionError(f"the {media_type} image does not decode: {e}") from None
    return image.convert("RGB")


def as_pil(image: Any, *, max_pixels: int = MAX_PIXELS) -> Any:
    """A PIL image as RGB, or a `(bytes, media_type)` pair decoded (`decode_image`)."""
    if isinstance(image, tuple) and len(image) == 2 and isinstance(image[0], (bytes, bytearray)):
        return decode_image(bytes(image[0]), str(image[1]), max_pixels=max_pixels)
    if hasattr(image, "convert") and hasattr(image, "size"):
        return image.convert("RGB")
    raise VisionError(f"an image must be a PIL image or (bytes, media_type), not {type(image).__name__}")


def image_token(processor: Any) -> str:
    """The token the processor expands into an image's tokens (`<image>`, `<|image_pad|>`): one per image."""
    token = getattr(processor, "image_token", None)
    if not isinstance(token, str):
        raise VisionError(f"{type(processor).__name__} has no image token: not a vision-language processor")
    return token


def placeholder(processor: Any) -> str:
    """The text that stands for one image in a prompt before expansion, as the chat template writes it: the image
    token (`<image>`), between the processor's vision markers where it has them
    (`<|vision_start|><|image_pad|><|vision_end|>`)."""
    start, end = getattr(processor, "vision_start_token", None), getattr(processor, "vision_end_token", None)
    token = image_token(processor)
    return f"{start}{token}{end}" if isinstance(start, str) and isinstance(end, str) else token


def unpaired_images(processor: Any, text: str, images: int) -> str | None:
    """None when `text` has one image token (`image_token`: what the processor expands) per image; else why not."""
    token = image_token(processor)
    marks = text.count(token)
    if marks == images:
        return None
    return f"the prompt has {marks} image placeholders ({token}) for {images} images"


def image_token_ids(processor: Any) -> frozenset[int]:
    """The ids of the tokens an image expands into (the image token, and Idefics3's markers: the tokens around
    images, `<global-img>`, `<row_i_col_j>`)."""
    ids: set[int] = set()
    for name in ("image_token_id", "fake_image_token_id", "global_image_token_id"):
        value = getattr(processor, name, None)
        if isinstance(value, int):
            ids.add(value)
    for row in getattr(processor, "row_col_ids", None) or ():
        ids.update(row if isinstance(row, (list, tuple)) else [row])
    return frozenset(ids)


def render_chat(processor: Any, messages: list[dict]) -> str:
    """Chat messages (content a string, or a list of `{"type": "text", "text"}` and `{"type": "image"}` parts) as
    the prompt text of the processor's chat template, with the assistant's header, images as placeholders."""
    try:
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja's errors, or a processor without a template
        raise VisionError(f"the processor's chat template failed on these messages: {e}") from None
    return str(text)


def task_prompt_text(processor: Any, prompt: str, images: int, chat: Any = None) -> str:
    """The text an image task's prompt reaches the engine as (what explorers send, and what demonstrations train on):
    with `chat` (rft.text.chat's `ChatPrompt.of(model)`), its `image_messages` rendered by the processor's template;
    else one placeholder per image, then the prompt. VisionError when the template fails."""
    if chat is None:
        return placeholder(processor) * images + prompt
    return render_chat(processor, chat.image_messages(prompt, images))


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt as the model sees it: `token_ids` with every image placeholder expanded, `pixels` the processor's
    image tensors (`pixel_values`, and per family `pixel_attention_mask`, `image_grid_thw`), `image_tokens` how many
    of the ids belong to images."""
    token_ids: list[int]
    pixels: dict[str, Any] = field(default_factory=dict)
    image_tokens: int = 0


def process_prompt(processor: Any, prompt: str | list[dict], images: Sequence[Any], *,
                   max_pixels: int = MAX_PIXELS) -> ProcessedPrompt:
    """Run the processor on a prompt and its images: `prompt` is text with one placeholder (`placeholder`; what counts
    is its image token, `unpaired_images`) per image in order, or chat messages (`render_chat`). VisionError when the
    placeholders and images do not pair up or the processor refuses them."""
    text = render_chat(processor, prompt) if isinstance(prompt, list) else prompt
    pils = [as_pil(image, max_pixels=max_pixels) for image in images]
    problem = unpaired_images(processor, text, len(pils))
    if problem is not None:
        raise VisionError(problem)
    try:
        out = processor(text=[text], images=[pils] if pils else None, return_tensors="pt")
    except (ValueError, TypeError) as e:
        raise VisionError(f"the processor refused the prompt: {e}") from None
    ids = [int(t) for t in out["input_ids"][0]]
    pixels = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "token_type_ids",
                                                          "mm_token_type_ids")}
    marked = image_token_ids(processor)
    return ProcessedPrompt(ids, pixels, sum(1 for t in ids if t in marked))


def prompt_mismatch(engine_ids: Sequence[int], expected: Sequence[int], *,
                    image_ids: frozenset[int] = frozenset()) -> str | None:
    """None when the engine's prompt ids equal the processor's (`process_prompt(...).token_ids`); else the reason:
    the lengths and image-token counts, and the first position that differs."""
    engine, mine = list(engine_ids), list(expected)
    if engine == mine:
        return None
    counts = ""
    if image_ids:
        counts = (f" (image tokens: engine {sum(t in image_ids for t in engine)}, processor "
                  f"{sum(t in image_ids for t in mine)})")
    first = next((i for i, (a, b) in enumerate(zip(engine, mine, strict=False)) if a != b), min(len(engine), len(mine)))
    at = (f"first difference at position {first}: engine {engine[first] if first < len(engine) else 'end'}, "
          f"processor {mine[first] if first < len(mine) else 'end'}")
    return f"the engine's prompt is {len(engine)} tokens, the processor's {len(mine)}{counts}; {at}"


def reprocessed(processor: Any, prompt: str | list[dict], images: Sequence[Any], *,
                max_pixels: int = MAX_PIXELS) -> ProcessedPrompt | str:
    """`process_prompt` of a recorded sample's prompt and images, or why the processor refuses them (for the group's
    dead letter)."""
    try:
        return process_prompt(processor, prompt, images, max_pixels=max_pixels)
    except VisionError as e:
        return f"the processor refuses the sample's prompt: {e}"


def engine_prompt_problem(processor: Any, prompt: str | list[dict], images: Sequence[Any],
                          engine_ids: Sequence[int]) -> str | None:
    """What the trainer checks for every sample (rft/trainer/images.py, which keeps `reprocessed`'s result for the
    sample's pixels): None when re-running the processor on the sample's prompt and images gives exactly the prompt
    ids the engine recorded; else the reason (a processor that refuses them, or `prompt_mismatch`'s)."""
    expected = reprocessed(processor, prompt, images)
    if isinstance(expected, str):
        return expected
    return prompt_mismatch(engine_ids, expected.token_ids, image_ids=image_token_ids(processor))


def prompt_length_problem(processed: ProcessedPrompt, max_prompt_len: int) -> str | None:
    """None when the whole prompt (its image tokens included) fits `max_prompt_len`; else why it is refused. A
    prompt is refused whole, never truncated: a cut could fall inside an image's tokens."""
    n = len(processed.token_ids)
    if n <= max_prompt_len:
        return None
    return (f"the prompt is {n} tokens ({processed.image_tokens} of them image tokens), over model.max_prompt_len "
            f"{max_prompt_len}; it is refused whole, never cut inside an image")
