"""The trainer's side of images (docs/architecture.md, "Images to the loss"). A sample with images carries the
encoded images and its `prompt_text` (the prompt as its engine's processor took it); the trainer re-runs the model's
processor on them (rft.models.vision: the one place a processor runs on a prompt) and
- `ImagePrompts.problem(sample)`: None when the sample's images are within the run's image limits and the processor
  expands its prompt to exactly the prompt ids the engine recorded (`engine_prompt_problem`'s check), and no
  placeholder stands in a prompt where no image is (a text prompt) nor any video placeholder in a prompt, else the
  reason; the feed dead-letters the group with it (rft.trainer.batch.TrainableLimits). A placeholder in a response
  (an engine may sample one) is trained as the engine ran it: an ordinary token (megatron_bridge.vision reads
  placeholders only inside each row's prompt);
- `ImagePrompts.pixels(sample)`: the processor's image tensors for the sample's row, which the model family collates
  into each micro-batch (megatron_bridge's `collate_images`) when the rank that trains the row packs it.
The processor runs once per distinct (prompt_text, images) a process sees: a group's samples share their prompt, and
on rank 0 the rows use what the feed's check computed. Results are kept least recently used first out, up to
`cache_bytes` of pixel tensors. Every rank builds its rows itself from the same record bytes (rft.trainer.main), so
pixel tensors never cross processes: each rank re-runs the processor on the images it received.
"""
from __future__ import annotations

import collections
import os
from typing import Any

from rft.models.vision import (
    ProcessedPrompt,
    VisionError,
    image_token,
    image_token_ids,
    is_vision_model,
    load_processor,
    prompt_mismatch,
    reprocessed,
)
from rft.schema import ImageLimits, Sample

CACHE_BYTES = 256 << 20  # pixel tensors kept per process (a few steps' prompts)
CACHE_ENTRIES = 4096  # results kept, refusals included


class ImagePrompts:
    """A vision-language model's processor as the trainer uses it (the module docstring). `limits`: the run's image
    limits (`data.max_images`, ...; the schema's ceiling by default). `runs` counts processor runs."""

    def __init__(self, processor: Any, *, limits: ImageLimits | None = None, cache_bytes: int = CACHE_BYTES):
        self.processor, self.limits = processor, limits or ImageLimits()
        self.image_ids = image_token_ids(processor)
        # the tokens the model reads as an image's (or a video's, which it refuses) placeholders: id -> token
        self.image_id = int(processor.tokenizer.convert_tokens_to_ids(image_token(processor)))
        self.placeholders = {self.image_id: image_token(processor)}
        video = getattr(processor, "video_token", None)
        if isinstance(video, str):
            self.placeholders[int(processor.tokenizer.convert_tokens_to_ids(video))] = video
        self.cache_bytes = cache_bytes
        self.runs = 0
        self._cache: collections.OrderedDict[tuple, ProcessedPrompt | str] = collections.OrderedDict()
        self._held = 0  # bytes of pixel tensors in the cache

    def problem(self, sample: Sample) -> str | None:
        """None when `sample` can be trained on as its engine saw it, else why not: besides the processor's check of
        a sample with images, no image placeholder (`<image>`, `<|image_pad|>`) may stand in a text sample's prompt,
        since the model puts an image feature at every placeholder of a prompt; nor a video placeholder
        (`<|video_pad|>`) in any prompt: videos are not taken. Placeholders in a response are ordinary tokens, to
        the engine as to the model."""
        for token, text in self.placeholders.items():
            if token in sample.prompt_tokens and (token != self.image_id or not sample.images):
                return (f"the prompt holds the placeholder {text!r} (id {token}) with "
                        f"{'no image' if token == self.image_id else 'no video: videos are not taken'}")
        if not sample.images:
            return None
        if problem := self.limits.problem(sample.images):
            return problem
        processed = self._processed(sample)
        if isinstance(processed, str):
            return processed
        return prompt_mismatch(sample.prompt_tokens.tolist(), processed.token_ids, image_ids=self.image_ids)

    def pixels(self, sample: Sample) -> dict[str, Any]:
        """The processor's image tensors (`ProcessedPrompt.pixels`) of `sample` (with images); VisionError when the
        processor refuses it (a group `problem` passed never is)."""
        processed = self._processed(sample)
        if isinstance(processed, str):
            raise VisionError(processed)
        return processed.pixels

    def _processed(self, sample: Sample) -> ProcessedPrompt | str:
        key = (sample.prompt_text, tuple(image.sha256 for image in sample.images))  # sha256: checked when decoded
        if (known := self._cache.get(key)) is not None:
            self._cache.move_to_end(key)
            return known
        self.runs += 1
        result = reprocessed(self.processor, sample.prompt_text,
                             [(image.data, image.media_type) for image in sample.images],
                             max_pixels=self.limits.max_image_pixels)
        self._cache[key] = result
        self._held += _nbytes(result)
        while len(self._cache) > 1 and (self._held > self.cache_bytes or len(self._cache) > CACHE_ENTRIES):
            _, dropped = self._cache.popitem(last=False)
            self._held -= _nbytes(dropped)
        return result


def image_prompts(model_path: str | os.PathLike, limits: ImageLimits | None = None) -> ImagePrompts | None:
    """The trainer's ImagePrompts for the model at `model_path` (its processor loaded once), None for a text model."""
    if not is_vision_model(model_path):
        return None
    return ImagePrompts(load_processor(model_path), limits=limits)


def _nbytes(result: ProcessedPrompt | str) -> int:
    if isinstance(result, str):
        return 0
    return sum(int(v.nbytes) for v in result.pixels.values() if hasattr(v, "nbytes"))
