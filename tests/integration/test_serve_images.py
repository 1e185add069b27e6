"""`rft serve` on a tiny random Idefics3 (transformers engine, a real broker, uvicorn in this process) over real
HTTP: an OpenAI image content part (a data URI) answered as the engine generates from the same image prompt, the
prompt's image tokens counted in `usage`, the request answered but not recorded; refusals as OpenAI 400 bodies."""
from __future__ import annotations

import base64
import time
from contextlib import contextmanager

import httpx
import openai
import pytest

from rft.engine import ImagePrompt, SamplingSettings, TransformersEngine
from rft.models.vision import load_processor, process_prompt
from rft.run.config import config_from_dict
from rft.serve.app import ServerThread
from rft.serve.server import build_service
from tests.vision_prompts import encoded_image

pytestmark = [pytest.mark.integration]

PNG = encoded_image(64, 48, seed=7)[0]
URI = "data:image/png;base64," + base64.b64encode(PNG).decode()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from rft.models.tiny_vlm import make_tiny_idefics3
    return make_tiny_idefics3(tmp_path_factory.mktemp("vlm") / "idefics3", longest_edge=64)


@contextmanager
def serving(broker, model_dir, tmp):
    """`rft serve` of `model_dir` on the transformers engine with the chat template: (config, url, service)."""
    cfg = config_from_dict({
        "run": {"name": f"serve-img-{int(time.time() * 1000) % 10**8}", "mode": "serve",
                "output_dir": str(tmp / "runs")},
        "model": {"path": str(model_dir), "max_prompt_len": 96, "max_response_len": 8, "chat_template": True},
        "kafka": {"bootstrap_servers": broker.bootstrap_servers, "partitions": 1},
        "explorer": {"engine": "transformers"},
        "serve": {"max_images": 2, "max_image_pixels": 64 * 64},
        "sync": {"weight_store": str(tmp / "store")},
    })
    service = build_service(cfg)
    thread = ServerThread(service).start()
    try:
        yield cfg, thread.url, service
    finally:
        thread.stop()
        service.close()


@pytest.fixture(scope="module")
def served(broker, vlm, tmp_path_factory):
    with serving(broker, vlm, tmp_path_factory.mktemp("serve-images")) as running:
        yield running


def test_an_image_part_is_answered_as_the_engine_generates(served, vlm):
    cfg, url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model=cfg.run.name, max_tokens=8, temperature=0.0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": URI}},
                                     {"type": "text", "text": "what colour?"}]}])
    text = "User:<image>what colour?<end_of_utterance>\nAssistant:"
    expected = process_prompt(load_processor(vlm), text, [(PNG, "image/png")])
    assert answer.usage.prompt_tokens == len(expected.token_ids) and expected.image_tokens == 31
    reference = TransformersEngine(vlm).generate_images([ImagePrompt(text, ((PNG, "image/png"),))],
                                                        SamplingSettings(n=1, temperature=0.0, max_tokens=8))
    assert answer.choices[0].message.content == reference[0].completions[0].text
    metrics = httpx.get(url + "/metrics").text  # answered, not recorded: the served record has no images yet
    assert "rft_serve_completions_recorded_total 0.0" in metrics


def test_refusals_are_openai_400_bodies(served):
    cfg, url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="remote image URLs are not fetched"):
        client.chat.completions.create(model=cfg.run.name, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}]}])
    big = "data:image/png;base64," + base64.b64encode(encoded_image(80, 60, seed=8)[0]).decode()
    reply = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": big}}]}]})
    assert reply.status_code == 400
    assert "80x60 pixels, over the limit of 4096" in reply.json()["error"]["message"]
    two = [{"type": "image_url", "image_url": {"url": URI}}] * 2  # 2 x 31 image tokens and the template: fits 96
    reply = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": two}],
                                                           "max_tokens": 2})
    assert reply.status_code == 200 and 62 < reply.json()["usage"]["prompt_tokens"] <= 96, reply.text
    reply = httpx.post(url + "/v1/chat/completions", json={"messages": [
        {"role": "user", "content": two}, {"role": "user", "content": [{"type": "text", "text": "x" * 40}]}]})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"


def test_an_image_part_on_qwen2_5_vl(broker, tmp_path_factory):
    """The same request to a tiny Qwen2.5-VL: its chat template writes the image as
    <|vision_start|><|image_pad|><|vision_end|>, expanded by rft's torchvision-free processor."""
    from rft.models.tiny_vlm import make_tiny_qwen2_5_vl

    tmp = tmp_path_factory.mktemp("serve-qwen-vl")
    qwen = make_tiny_qwen2_5_vl(tmp / "qwen2_5_vl")
    with serving(broker, qwen, tmp) as (cfg, url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(model=cfg.run.name, max_tokens=8, temperature=0.0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": URI}},
                                         {"type": "text", "text": "what colour?"}]}])
    text = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what colour?<|im_end|>\n"
            "<|im_start|>assistant\n")
    expected = process_prompt(load_processor(qwen), text, [(PNG, "image/png")])
    assert answer.usage.prompt_tokens == len(expected.token_ids) and expected.image_tokens == 12  # 48x64: 6x8 patches
    reference = TransformersEngine(qwen).generate_images([ImagePrompt(text, ((PNG, "image/png"),))],
                                                         SamplingSettings(n=1, temperature=0.0, max_tokens=8))
    assert answer.choices[0].message.content == reference[0].completions[0].text
