"""The processor contract (rft/models/vision.py) on the tiny Idefics3's processor (in memory): placeholders expanded
exactly as the processor does, the engine-versus-processor comparison, prompts refused whole, images checked before
they decode."""
from __future__ import annotations

import io

import pytest

from rft.models.tiny_vlm import tiny_idefics3_processor
from rft.models.vision import (
    ProcessedPrompt,
    VisionError,
    decode_image,
    engine_prompt_problem,
    image_token_ids,
    process_prompt,
    prompt_length_problem,
    prompt_mismatch,
    render_chat,
)
from tests.vision_prompts import encoded_image


@pytest.fixture(scope="module")
def processor():
    return tiny_idefics3_processor(longest_edge=64)


def test_placeholders_expand_as_the_processor_does(processor):
    image = encoded_image(64, 48, seed=0)
    text = "User:<image>what?<end_of_utterance>\nAssistant:"
    processed = process_prompt(processor, text, [image])
    direct = processor(text=[text], images=[[decode_image(*image)]], return_tensors="pt")
    assert processed.token_ids == direct["input_ids"][0].tolist()
    image_id = processor.image_token_id
    # 64x48: 2x2 tiles of 32 pixels and the global view, 4 image tokens each, with their markers
    assert processed.token_ids.count(image_id) == 5 * 4
    assert processed.image_tokens == 5 * (4 + 2) + 1  # each view: <fake>, its tag, 4 images; one <fake> closes
    assert tuple(processed.pixels["pixel_values"].shape) == (1, 5, 3, 32, 32)
    # chat messages render through the processor's template to the same prompt
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    assert render_chat(processor, messages) == text
    assert process_prompt(processor, messages, [image]).token_ids == processed.token_ids
    # text only: the tokenizer's ids, no pixels
    plain = process_prompt(processor, "3+4=", [])
    assert plain.token_ids == processor.tokenizer("3+4=")["input_ids"] and not plain.pixels


def test_placeholders_and_images_must_pair(processor):
    with pytest.raises(VisionError, match="2 image placeholders .* for 1 images"):
        process_prompt(processor, "<image><image>", [encoded_image(8, 8, seed=1)])
    with pytest.raises(VisionError, match="0 image placeholders"):
        process_prompt(processor, "no image", [encoded_image(8, 8, seed=1)])


def test_mismatch_names_the_difference(processor):
    ids = process_prompt(processor, "<image>x", [encoded_image(20, 20, seed=2)]).token_ids
    marks = image_token_ids(processor)
    assert prompt_mismatch(ids, ids, image_ids=marks) is None
    # an engine that expanded the image twice (the peers' double expansion)
    image_id = processor.image_token_id
    doubled = ids[:ids.index(image_id)] + [image_id] * 4 + ids[ids.index(image_id):]
    reason = prompt_mismatch(doubled, ids, image_ids=marks)
    assert reason is not None and f"{len(doubled)} tokens, the processor's {len(ids)}" in reason
    assert "image tokens: engine" in reason and f"position {ids.index(image_id) + 4}" in reason
    # a prefix of the processor's ids differs at its end
    assert "engine end" in (prompt_mismatch(ids[:-1], ids) or "")
    # the trainer's check of one sample: its prompt and images re-processed against the engine's ids
    image = encoded_image(20, 20, seed=2)
    assert engine_prompt_problem(processor, "<image>x", [image], ids) is None
    assert "image tokens: engine" in (engine_prompt_problem(processor, "<image>x", [image], doubled) or "")
    assert "refuses the sample's prompt" in (engine_prompt_problem(processor, "<image>x", [], ids) or "")


def test_a_prompt_over_the_limit_is_refused_whole():
    prompt = ProcessedPrompt(list(range(40)), image_tokens=31)
    assert prompt_length_problem(prompt, 40) is None
    reason = prompt_length_problem(prompt, 39)
    assert reason is not None and "40 tokens (31 of them image tokens)" in reason and "never cut" in reason


@pytest.mark.parametrize("media_type", ["image/png", "image/jpeg", "image/webp"])
def test_images_decode_by_their_media_type(media_type):
    data, _ = encoded_image(12, 7, seed=3, media_type=media_type)
    assert decode_image(data, media_type).size == (12, 7)


def test_images_are_checked_before_they_decode():
    png, _ = encoded_image(12, 7, seed=3)
    with pytest.raises(VisionError, match="not accepted"):
        decode_image(png, "image/gif")
    with pytest.raises(VisionError, match="not a image/jpeg image"):
        decode_image(png, "image/jpeg")  # the bytes are PNG: the declared type must hold
    with pytest.raises(VisionError, match="not a image/png image"):
        decode_image(b"\x89PNG not really", "image/png")
    with pytest.raises(VisionError, match="12x7 pixels, over the limit of 80"):
        decode_image(png, "image/png", max_pixels=80)
    truncated = png[:len(png) // 2]
    with pytest.raises(VisionError, match="does not decode"):
        decode_image(truncated, "image/png")


def test_a_huge_declared_size_is_refused_from_the_header():
    """A 5000x5000 PNG (over the default 4096 x 4096 pixels, under Pillow's own limit) of a few kilobytes: refused
    from its header, and one past Pillow's limit too."""
    from PIL import Image

    for side, message in ((5000, "5000x5000 pixels, over the limit"), (13500, "over the limit of")):
        buffer = io.BytesIO()
        Image.new("1", (side, side)).save(buffer, format="PNG")  # 1-bit, one colour: the file is small
        with pytest.raises(VisionError, match=message):
            decode_image(buffer.getvalue(), "image/png")
