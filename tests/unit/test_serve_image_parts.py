"""`rft serve`'s image content parts (rft/serve/requests.py), without a server: data URIs parsed within the limits,
every refusal a 400 naming the part, and a vision-language request rendered to one image prompt that is refused whole
over model.max_prompt_len (the tiny Idefics3's processor, in memory)."""
from __future__ import annotations

import base64

import pytest

from rft.models.config import ModelConfig
from rft.models.tiny_vlm import tiny_idefics3_processor
from rft.serve.requests import ApiError, ImageLimits, image_renderer, parse_chat_request
from tests.vision_prompts import encoded_image

LIMITS = ImageLimits(max_images=2, max_image_bytes=20_000, max_image_pixels=64 * 64)


def image_part(data: bytes, media_type: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{base64.b64encode(data).decode()}"}}


def body(*parts: dict, role: str = "user") -> dict:
    return {"messages": [{"role": "system", "content": "look"},
                         {"role": role, "content": [*parts, {"type": "text", "text": "what?"}]}]}


def parse(request: dict, limits: ImageLimits = LIMITS):
    return parse_chat_request(request, model_name="m", max_tokens=8, images=limits)


def refusal(request: dict, limits: ImageLimits = LIMITS) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(request, limits)
    assert e.value.status == 400
    return e.value


def test_image_parts_become_processor_parts():
    png = encoded_image(20, 10, seed=0)[0]
    webp = encoded_image(8, 8, seed=1, media_type="image/webp")[0]
    request = parse(body(image_part(png), image_part(webp, "image/webp")))
    assert request.images == ((png, "image/png"), (webp, "image/webp"))
    assert request.messages == [{"role": "system", "content": [{"type": "text", "text": "look"}]},
                                {"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                             {"type": "text", "text": "what?"}]}]
    assert parse({"messages": [{"role": "user", "content": "plain"}]}).images == ()


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "remote image URLs are not fetched"),
    ({"type": "image_url", "image_url": {"url": "data:image/gif;base64,R0lGODlh"}}, "'image/gif' is not accepted"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}}, "base64 does not decode"),
    ({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}, "not a base64 data URI"),
    ({"type": "image_url", "image_url": {}}, "expected {\"url\""),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 40_000}},
     "over serve.max_image_bytes = 20000"),
])
def test_bad_image_parts_are_refused_by_name(part, message):
    error = refusal(body(part))
    assert message in str(error) and error.param == "messages[1].content[0]"


def test_image_count_role_and_model_limits():
    png = image_part(encoded_image(8, 8, seed=2)[0])
    assert "more than serve.max_images = 2" in str(refusal(body(png, png, png)))
    assert "user messages only" in str(refusal(body(png, role="assistant")))
    assert "must be text or image_url" in str(refusal(body(png, {"type": "audio", "audio": "x"})))
    assert "takes no images" in str(refusal(body(png), ImageLimits()))  # a text model
    with pytest.raises(ApiError, match="not by an adapter"):
        parse_chat_request({**body(png), "model": "other"}, model_name="m", max_tokens=8, adapters=("other",),
                           images=LIMITS)


@pytest.fixture(scope="module")
def render():
    model = ModelConfig(path="unused", max_prompt_len=80, chat_template=True)
    return image_renderer(model, tiny_idefics3_processor(longest_edge=64), LIMITS.max_image_pixels)


def test_a_request_renders_to_one_image_prompt(render):
    png = encoded_image(64, 48, seed=3)[0]
    request = parse(body(image_part(png)))
    prompt = render(request.messages, request.images)
    assert prompt.text == "System:look<end_of_utterance>\nUser:<image>what?<end_of_utterance>\nAssistant:"
    assert len(prompt.images) == 1 and prompt.images[0].size == (64, 48)


def test_images_over_the_pixel_limit_or_not_their_type_are_refused(render):
    big = parse(body(image_part(encoded_image(65, 64, seed=4)[0])))
    with pytest.raises(ApiError, match="65x64 pixels, over the limit of 4096"):
        render(big.messages, big.images)
    jpeg_as_png = parse(body(image_part(encoded_image(8, 8, seed=5, media_type="image/jpeg")[0], "image/png")))
    with pytest.raises(ApiError, match="not a image/png image"):
        render(jpeg_as_png.messages, jpeg_as_png.images)


def test_a_prompt_over_max_prompt_len_is_refused_whole(render):
    png = image_part(encoded_image(64, 64, seed=6)[0])
    request = parse(body(png, png))  # two split images: 62 image tokens, and the text
    with pytest.raises(ApiError, match=r"over model.max_prompt_len 80; it is refused whole") as e:
        render(request.messages, request.images)
    assert e.value.code == "context_length_exceeded"
