"""Qwen2.5-VL's processor without torchvision (rft/models/qwen_vl.py) under the processor contract
(rft/models/vision.py), on the tiny Qwen2.5-VL's tokenizer and PIL image processor (in memory): each `<|image_pad|>`
expands exactly as transformers' Qwen2.5-VL expansion does on the image processor's grid, for images below, inside and
above the pixel limits; the placeholder is what the chat template writes; the vLLM engine refuses Qwen2.5-VL where
torchvision does not import, before vLLM loads."""
from __future__ import annotations

import json

import pytest

from rft.engine import EngineError
from rft.models.qwen_vl import QwenVLImageProcessor
from rft.models.tiny_vlm import tiny_qwen2_5_vl_parts
from rft.models.vision import (
    VisionError,
    decode_image,
    engine_prompt_problem,
    image_token_ids,
    load_processor,
    placeholder,
    process_prompt,
    prompt_length_problem,
    render_chat,
)
from tests.vision_prompts import encoded_image

MARK = "<|vision_start|><|image_pad|><|vision_end|>"
# (width, height) -> the image processor's grid (t, h, w) in 8-pixel patches, worked out by hand from Qwen's resize
# (sides rounded to multiples of 16, then scaled into 32x32..64x64 pixels: 48x20 up to 64x32, 300x200 down to 64x48,
# 100x7 up to 128x16)
SIZES = {(32, 32): (1, 4, 4), (64, 64): (1, 8, 8), (40, 24): (1, 4, 4), (48, 20): (1, 4, 8), (12, 12): (1, 4, 4),
         (300, 200): (1, 6, 8), (100, 7): (1, 2, 16)}


def torchvision_imports() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def processor():
    fast, image_processor = tiny_qwen2_5_vl_parts()
    return QwenVLImageProcessor(image_processor=image_processor, tokenizer=fast, chat_template=fast.chat_template)


def expanded(processor, text: str, grids: list[tuple[int, int, int]]) -> list[int]:
    """transformers' Qwen2.5-VL expansion written out: the i-th `<|image_pad|>` becomes t*h*w / merge_size**2 of
    them, then the text is tokenized."""
    merge = processor.image_processor.merge_size
    parts = text.split("<|image_pad|>")
    assert len(parts) == len(grids) + 1
    out = parts[0]
    for (t, h, w), part in zip(grids, parts[1:], strict=True):
        out += "<|image_pad|>" * (t * h * w // merge ** 2) + part
    return processor.tokenizer(out)["input_ids"]


@pytest.mark.parametrize("size", list(SIZES))
def test_each_image_pad_expands_as_transformers_does(processor, size):
    image = encoded_image(*size, seed=size[0])
    text = f"<|im_start|>user\n{MARK}what?<|im_end|>\n<|im_start|>assistant\n"
    processed = process_prompt(processor, text, [image])
    alone = processor.image_processor(images=[decode_image(*image)], return_tensors="pt")
    grid = tuple(alone["image_grid_thw"][0].tolist())
    assert grid == SIZES[size]
    assert processed.token_ids == expanded(processor, text, [grid])
    assert processed.image_tokens == grid[0] * grid[1] * grid[2] // 4
    assert processed.pixels["image_grid_thw"].tolist() == [list(grid)]
    # one row of 3 channels x 2 frames x 8 x 8 pixels per patch, the same values as the image processor's alone
    assert tuple(processed.pixels["pixel_values"].shape) == (grid[0] * grid[1] * grid[2], 3 * 2 * 8 * 8)
    assert processed.pixels["pixel_values"].equal(alone["pixel_values"])


def test_chat_messages_and_two_images(processor):
    images = [encoded_image(64, 64, seed=1), encoded_image(300, 200, seed=2)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                             {"type": "text", "text": "?"}]}]
    text = render_chat(processor, messages)
    assert placeholder(processor) == MARK and text.count(MARK) == 2
    assert text == f"<|im_start|>user\n{MARK}and{MARK}?<|im_end|>\n<|im_start|>assistant\n"
    processed = process_prompt(processor, messages, images)
    assert processed.token_ids == process_prompt(processor, text, images).token_ids
    assert processed.token_ids == expanded(processor, text, [(1, 8, 8), (1, 6, 8)])
    assert image_token_ids(processor) == {processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")}
    assert processed.image_tokens == 16 + 12
    assert processed.pixels["image_grid_thw"].tolist() == [[1, 8, 8], [1, 6, 8]]
    assert tuple(processed.pixels["pixel_values"].shape) == (64 + 48, 384)  # both images' patches, concatenated
    assert "28 of them image tokens" in (prompt_length_problem(processed, 40) or "")


def test_placeholders_pair_with_images_by_their_image_token(processor):
    image = encoded_image(32, 32, seed=3)
    with pytest.raises(VisionError, match=r"2 image placeholders \(<\|image_pad\|>\) for 1 images"):
        process_prompt(processor, f"{MARK}{MARK}x", [image])
    with pytest.raises(VisionError, match="0 image placeholders"):
        process_prompt(processor, "<|vision_start|><|vision_end|>x", [image])
    ids = process_prompt(processor, f"{MARK}x", [image]).token_ids
    assert engine_prompt_problem(processor, f"{MARK}x", [image], ids) is None
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    doubled = ids[:1] + [pad] * 4 + ids[1:]  # expanded twice
    assert "image tokens: engine 8, processor 4" in (engine_prompt_problem(processor, f"{MARK}x", [image], doubled)
                                                     or "")


def test_load_processor_picks_it_for_a_qwen2_5_vl_directory(tmp_path, processor):
    for part in tiny_qwen2_5_vl_parts():
        part.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    loaded = load_processor(tmp_path)
    assert isinstance(loaded, QwenVLImageProcessor) and not hasattr(loaded, "video_processor")
    image = encoded_image(40, 24, seed=4)
    text = render_chat(loaded, [{"role": "user", "content": [{"type": "image"}]}])
    assert process_prompt(loaded, text, [image]).token_ids == process_prompt(processor, text, [image]).token_ids
    if not torchvision_imports():  # why rft has its own: transformers' wants a torchvision-only video processor
        from transformers import AutoProcessor

        with pytest.raises(ImportError, match="Torchvision"):
            AutoProcessor.from_pretrained(str(tmp_path))


@pytest.mark.skipif(torchvision_imports(), reason="torchvision imports here: vLLM's Qwen2.5-VL can load")
def test_the_vllm_engine_refuses_qwen2_5_vl_without_torchvision(tmp_path):
    from rft.engine.vllm_engine import VLLMEngine, torchvision_problem

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    with pytest.raises(EngineError, match=r"qwen2_5_vl model needs torchvision.*explorer\.engine: transformers"):
        VLLMEngine(tmp_path)  # refused before vLLM is imported or the directory read further
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "idefics3", "vision_config": {}}))
    assert torchvision_problem(tmp_path) is None
