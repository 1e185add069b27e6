"""Image prompts shared by the vision engine tests (tests/integration/test_vision_engine.py and its probe): seeded
images, encoded as the records carry them ((bytes, media_type)), and prompt texts with Idefics3's `<image>`."""
from __future__ import annotations

import io
from typing import Any

import numpy as np

# (text, image sizes): a split image (tiles and a global view), a small unsplit one, two images in one prompt
PROMPTS = [("User:<image>what colour?<end_of_utterance>\nAssistant:", ((64, 48),)),
           ("<image>3+4=", ((20, 20),)),
           ("User:<image>and<image>?<end_of_utterance>\nAssistant:", ((40, 64), (32, 32)))]


def encoded_image(width: int, height: int, seed: int, media_type: str = "image/png") -> tuple[bytes, str]:
    """A seeded noise image of that size, encoded (png, jpeg or webp)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=media_type.split("/")[1].upper())
    return buffer.getvalue(), media_type


def image_prompts(processor: Any = None) -> list:
    """PROMPTS as rft.engine.ImagePrompt, each image seeded by its position."""
    from rft.engine import ImagePrompt

    return [ImagePrompt(text, tuple(encoded_image(w, h, seed=10 * i + j) for j, (w, h) in enumerate(sizes)))
            for i, (text, sizes) in enumerate(PROMPTS)]
