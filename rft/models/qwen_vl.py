"""Qwen2.5-VL's processor for images and text, without torchvision.

transformers' `Qwen2_5_VLProcessor` takes a video processor that exists only with torchvision (`AutoProcessor` raises
ImportError without it), and rft sends no video. `QwenVLImageProcessor` is that processor with the video part left
out: the same code expands each `<|image_pad|>` into `grid_t * grid_h * grid_w // merge_size**2` copies and returns
`pixel_values` (the flattened patches) with `image_grid_thw`. Its image processor is what transformers picks for the
directory: the PIL one (`Qwen2VLImageProcessorPil`) without torchvision, the torchvision one with it; both resize
with the same `smart_resize`, so the token layout is the same on every machine. Imports transformers.
"""
from __future__ import annotations

from typing import Any

from transformers import Qwen2_5_VLProcessor

MODEL_TYPES = ("qwen2_5_vl",)  # config.json model_type values whose processor this is
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


class QwenVLImageProcessor(Qwen2_5_VLProcessor):
    """transformers' `Qwen2_5_VLProcessor` without a video processor (module docstring); `vision_start_token` and
    `vision_end_token` are the markers a prompt writes around each image's `<|image_pad|>` (as Qwen3-VL's processor
    names them)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any):
        # the processor's parts are the arguments of this signature: the video processor is not one
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        self.vision_start_token = getattr(tokenizer, "vision_start_token", None) or VISION_START
        self.vision_end_token = getattr(tokenizer, "vision_end_token", None) or VISION_END


def load(path: str) -> QwenVLImageProcessor:
    """The processor of the Qwen2.5-VL directory at `path`: its image processor config (preprocessor_config.json),
    tokenizer and chat template."""
    return QwenVLImageProcessor.from_pretrained(path)
