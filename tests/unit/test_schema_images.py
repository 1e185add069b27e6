"""Images in records (docs/schema.md, "Images"): text records read and write unchanged; a task's and a sample's
images are checked where they are decoded (media type against the magic bytes, SHA-256, count and byte caps, the
header's width x height before any pixel is decoded: a decompression bomb is refused), each with a reason naming the
image; a run's own limits (ImageLimits.of(data)) are lower than the schema's ceiling and named by their keys."""
from __future__ import annotations

import hashlib
import io

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image as PILImage

from rft.data.config import DataConfig
from rft.schema import (
    MAX_IMAGE_BYTES,
    MAX_IMAGES,
    MAX_PROMPT_TEXT_CHARS,
    Image,
    ImageLimits,
    RecordError,
    TaskRecord,
    decode,
    decode_group,
    decode_task,
    encode,
    image_dimensions,
    image_problem,
)
from tests.records import make_group, make_image, png_bomb

PNG = make_image(12, 7)


def _pack(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _task_body(images: list) -> dict:
    body = msgpack.unpackb(encode(TaskRecord("run", "t", 0, "what colour?"))[0], raw=False)
    body["images"] = images
    return body


def _reason(body: dict, **kwargs) -> str:
    with pytest.raises(RecordError) as e:
        decode(_pack(body), **kwargs)
    return str(e.value)


def _wire(image: Image) -> dict:
    return {"data": image.data, "media_type": image.media_type, "sha256": image.sha256}


def test_text_records_are_unchanged_on_the_wire_and_read_as_no_images():
    task, group = TaskRecord("run", "t", 0, "2+2?"), make_group("run", 0)
    assert "images" not in msgpack.unpackb(encode(task)[0])
    assert all("images" not in s for s in msgpack.unpackb(encode(group)[0])["samples"])
    assert decode_task(*encode(task)).images == [] and all(s.images == [] for s in decode_group(*encode(group)).samples)
    body = _task_body(None)  # nil reads as none too
    assert decode_task(_pack(body)).images == []


@pytest.mark.parametrize("fmt, media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
def test_each_media_type_round_trips_and_its_header_size_agrees_with_pil(fmt, media_type):
    image = make_image(37, 21, fmt=fmt, seed=3)
    assert image.media_type == media_type and image.sha256 == hashlib.sha256(image.data).hexdigest()
    assert image_dimensions(image.data, media_type) == PILImage.open(io.BytesIO(image.data)).size == (37, 21)
    group = make_group("run", 1, n_samples=3)
    for s in group.samples:
        s.images, s.prompt_text = [image, PNG], "<image><image>which shape?"
    assert decode_group(*encode(group)) == group
    task = TaskRecord("run", "t", 0, "which shape?", images=[image])
    assert decode_task(*encode(task)) == task


def test_lossless_and_alpha_webp_and_progressive_jpeg_headers_are_read():
    for fmt, mode, options in (("WEBP", "RGB", {"lossless": True}), ("WEBP", "RGBA", {}),
                               ("JPEG", "RGB", {"progressive": True})):
        out = io.BytesIO()
        PILImage.new(mode, (300, 2)).save(out, fmt, **options)
        assert image_problem(Image.of(out.getvalue())) is None
        assert image_dimensions(out.getvalue(), Image.of(out.getvalue()).media_type) == (300, 2)


@pytest.mark.parametrize("change, expected", [
    ({"media_type": "image/gif"}, "media type 'image/gif' is not one of"),
    ({"media_type": "image/jpeg"}, "are not image/jpeg (its magic bytes do not agree)"),
    ({"sha256": "0" * 64}, "is not the SHA-256 of its"),
    ({"data": PNG.data[:16]}, "is not the SHA-256"),
    ({"data": 5}, "field 'data': expected bytes"),
    ({"sha256": None}, "field 'sha256': expected str"),
])
def test_a_bad_image_is_rejected_naming_it(change, expected):
    body = _task_body([_wire(PNG), {**_wire(PNG), **change}])
    assert expected in _reason(body) and _reason(body).startswith("images[1]: ")


def test_a_header_without_a_size_is_rejected():
    data = PNG.data[:12] + b"JUNK" + PNG.data[16:]  # the magic bytes agree, the IHDR does not
    body = _task_body([_wire(Image(data, "image/png", hashlib.sha256(data).hexdigest()))])
    assert "header declares no readable width and height" in _reason(body)
    body["images"] = {"data": PNG.data}
    assert "images: expected an array, got dict" in _reason(body)
    body["images"] = [PNG.data]
    assert "images[0]: expected a map" in _reason(body)


def test_a_decompression_bomb_is_refused_before_it_decodes():
    """A valid 8192 x 8192 PNG of a few kB (PIL agrees on its size) is refused by its header alone."""
    bomb = png_bomb()
    assert len(bomb) < 100_000 and PILImage.open(io.BytesIO(bomb)).size == (8192, 8192)
    image = Image.of(bomb)
    reason = _reason(_task_body([_wire(image)]))
    assert "images[0]: 8192 x 8192 pixels, outside 1 .. rft.schema.MAX_IMAGE_PIXELS = 16777216" in reason
    assert "decompression bomb" in reason
    with pytest.raises(ValueError, match="8192 x 8192 pixels"):
        encode(TaskRecord("run", "t", 0, "p", images=[image]))  # nor is one written


def test_the_schema_caps_count_and_bytes():
    assert f"images: {MAX_IMAGES + 1} images, over rft.schema.MAX_IMAGES = {MAX_IMAGES}" in _reason(
        _task_body([_wire(PNG)] * (MAX_IMAGES + 1)))
    big = Image.of(PNG.data + b"\0" * MAX_IMAGE_BYTES)  # a PNG with trailing bytes past the cap
    assert f"over rft.schema.MAX_IMAGE_BYTES = {MAX_IMAGE_BYTES} (an image is refused whole" in _reason(
        _task_body([_wire(big)]))


def test_a_runs_limits_are_named_by_their_keys():
    limits = ImageLimits.of(DataConfig(max_images=2, max_image_bytes=len(PNG.data), max_image_pixels=12 * 7))
    assert decode_task(_pack(_task_body([_wire(PNG)] * 2)), images=limits).images == [PNG] * 2
    assert "3 images, over data.max_images = 2" in _reason(_task_body([_wire(PNG)] * 3), images=limits)
    larger = make_image(12, 8)
    assert "12 x 8 pixels, outside 1 .. data.max_image_pixels = 84" in (image_problem(larger, limits) or "")
    noisy = make_image(12, 7, noise=True)
    assert f"{len(noisy.data)} bytes, over data.max_image_bytes = {len(PNG.data)}" in _reason(
        _task_body([_wire(noisy)]), images=limits)
    group = make_group("run", 2)
    group.samples[1].images, group.samples[1].prompt_text = [PNG] * 3, "<image>" * 3
    value, headers = encode(group)
    with pytest.raises(RecordError, match=r"samples\[1\]: images: 3 images, over data.max_images = 2"):
        decode_group(value, headers, images=limits)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_corrupted_images_raise_only_record_error(data):
    """An image map's field replaced by any msgpack value, or its bytes cut or flipped anywhere: RecordError only."""
    group = make_group("run", 3, n_samples=2)
    group.samples[1].images = [PNG, make_image(9, 4, fmt=data.draw(st.sampled_from(["JPEG", "WEBP"])))]
    group.samples[1].prompt_text = "<image><image>?"
    body = msgpack.unpackb(encode(group)[0], raw=False)
    image = body["samples"][1]["images"][data.draw(st.integers(0, 1))]
    field = data.draw(st.sampled_from(["data", "media_type", "sha256"]))
    if field == "data" and data.draw(st.booleans()):
        raw = image["data"]
        at = data.draw(st.integers(0, len(raw) - 1))
        flipped = raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1:]
        image["data"] = raw[:at] if data.draw(st.booleans()) else flipped
    else:
        values = st.none() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.text(max_size=70) | st.binary(max_size=40)
        image[field] = data.draw(values)
    with pytest.raises(RecordError, match=r"samples\[1\]: images\[\d\]: "):
        decode(_pack(body))


def test_a_sample_with_images_carries_its_prompt_text_and_only_then():
    """The trainer re-runs the processor on `prompt_text` and the images: a sample with images must carry it (the
    unexpanded prompt), a text sample must not, and it is capped; checked when written and when read."""
    group = make_group("run", 2)
    group.samples[0].images = [PNG]
    with pytest.raises(ValueError, match="a sample with images needs its prompt_text"):
        encode(group)
    group.samples[0].prompt_text = "User:<image>what shape?<end_of_utterance>\nAssistant:"
    assert decode_group(*encode(group)).samples[0].prompt_text == group.samples[0].prompt_text
    body = msgpack.unpackb(encode(group)[0], raw=False)
    del body["samples"][0]["prompt_text"]
    with pytest.raises(RecordError, match=r"samples\[0\]: a sample with images needs its prompt_text"):
        decode(_pack(body))
    body["samples"][1]["prompt_text"] = "no images here"
    body["samples"][0]["prompt_text"] = "x" * (MAX_PROMPT_TEXT_CHARS + 1)
    with pytest.raises(RecordError, match=r"samples\[0\]: prompt_text is 1048577 characters, over 1048576"):
        decode(_pack(body))
    body["samples"][0]["prompt_text"] = "<image>"
    with pytest.raises(RecordError, match=r"samples\[1\]: prompt_text is only carried by a sample with images"):
        decode(_pack(body))
