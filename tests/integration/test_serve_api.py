"""`rft serve`'s endpoint over real HTTP (uvicorn in this process, a real broker, the tiny model on the transformers
engine), driven by the official `openai` client and by raw HTTP (httpx): completions, streaming, n > 1, stop strings,
OpenAI-style errors, every completion recorded once on the served topic, feedback accepted once and refused with
4xx codes otherwise (also after a restart: the ledger is read back from the topics), the joiner's groups, and a
weights version published to the store reported by the next response."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from rft.run.config import config_from_dict
from rft.schema import Feedback, ServedCompletion, decode
from rft.serve.app import ServerThread
from rft.serve.joiner import Joiner
from rft.serve.ledger import FeedbackLedger, FeedbackRefused
from rft.serve.server import build_service
from rft.transport import connect
from rft.transport.run_topics import RunTopics
from rft.weights.store import WeightStore, iter_safetensors
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration]

MESSAGES = [{"role": "system", "content": "copy"}, {"role": "user", "content": ":7"}]


@pytest.fixture(scope="module")
def served(broker, tiny_model, tmp_path_factory):
    """(config, base URL, service) of one server for the module."""
    tmp = tmp_path_factory.mktemp("serve")
    cfg = config_from_dict({
        "run": {"name": f"serve-{int(time.time() * 1000) % 10**8}", "mode": "serve", "output_dir": str(tmp / "runs")},
        "model": {"path": str(tiny_model), "max_prompt_len": 32, "max_response_len": 8},
        "kafka": {"bootstrap_servers": broker.bootstrap_servers, "partitions": 2},
        "explorer": {"engine": "transformers"},
        "serve": {"group_size": 2, "group_wait_s": 1.0},
        "sync": {"weight_store": str(tmp / "store")},
    })
    service = build_service(cfg)
    thread = ServerThread(service).start()
    yield cfg, thread.url, service
    thread.stop()
    service.close()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0)


def records(cfg, kind: str) -> list:
    source = connect(cfg.kafka).source()
    try:
        return [decode(m.value, m.headers) for m in source.read_range(cfg.topic(kind), idle_timeout_s=3.0)]
    finally:
        source.close()


def served_record(cfg, request_id: str) -> ServedCompletion:
    found = [r for r in records(cfg, "served") if r.request_id == request_id]
    assert len(found) == 1, f"{request_id} recorded {len(found)} times"
    return found[0]


def test_completion_is_answered_and_recorded_once(served, client):
    cfg, _, service = served
    answer = client.chat.completions.create(model=cfg.run.name, messages=MESSAGES, max_tokens=6, temperature=0.7)
    assert answer.id.startswith("chatcmpl-") and answer.object == "chat.completion"
    [choice] = answer.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert answer.model_extra["policy_version"] == 0 and answer.system_fingerprint == "rft-v0"
    record = served_record(cfg, answer.id)
    [recorded] = record.choices
    assert len(recorded.response_tokens) == len(recorded.logprobs) == answer.usage.completion_tokens <= 6
    assert len(record.prompt_tokens) == answer.usage.prompt_tokens and record.policy_version == 0
    assert service.worker.engine.decode(recorded.response_tokens) == choice.message.content
    assert (recorded.logprobs <= 0).all() and record.metadata["temperature"] == 0.7


def test_n_choices_streaming_and_stop_strings(served, client):
    cfg = served[0]
    answer = client.chat.completions.create(model=cfg.run.name, messages=MESSAGES, n=3, max_tokens=4)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert len(served_record(cfg, answer.id).choices) == 3

    chunks = list(client.chat.completions.create(model=cfg.run.name, messages=MESSAGES, max_tokens=6, stream=True))
    assert len({c.id for c in chunks}) == 1 and chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    record = served_record(cfg, chunks[0].id)
    assert text == served[2].worker.engine.decode(record.choices[0].response_tokens)

    greedy = client.chat.completions.create(model=cfg.run.name, messages=MESSAGES, max_tokens=8, temperature=0)
    full = greedy.choices[0].message.content
    assert len(full) >= 3, full
    cut = client.chat.completions.create(model=cfg.run.name, messages=MESSAGES, max_tokens=8, temperature=0,
                                         stop=[full[2]])
    assert cut.choices[0].message.content == full[:full.index(full[2])]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, status, code", [
    ({"temperature": 1.0}, 400, None),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, None),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, 404, "model_not_found"),
    ({"messages": [{"role": "user", "content": "x" * 60}]}, 400, "context_length_exceeded"),
])
def test_bad_requests_get_openai_error_bodies(served, body, status, code):
    reply = httpx.post(served[1] + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["code"] == code
    assert httpx.post(served[1] + "/v1/chat/completions", content=b"{nope", timeout=30,
                      headers={"Content-Type": "application/json"}).status_code == 400


def test_the_openai_client_sees_the_errors(served, client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=served[0].run.name, messages=MESSAGES, max_tokens=-1)


def test_feedback_is_taken_once_and_joined_into_a_group(served, client):
    cfg, url, _ = served
    answer = client.chat.completions.create(model=cfg.run.name, messages=MESSAGES, n=2, max_tokens=3)
    post = lambda body: httpx.post(url + "/v1/feedback", json=body, timeout=30)  # noqa: E731
    ok = post({"id": answer.id, "reward": 1.0, "components": {"thumbs": 1.0}})
    assert ok.status_code == 200 and ok.json()["accepted"] == 1
    for body, status, code in [({"id": answer.id, "reward": 0.5}, 409, "already_rewarded"),
                               ({"id": "chatcmpl-nope", "reward": 1.0}, 404, "unknown_id"),
                               ({"id": answer.id, "reward": 1.0, "index": 5}, 400, "invalid_index"),
                               ({"id": answer.id, "reward": "good"}, 400, None),
                               ({"feedback": [{"id": answer.id, "reward": 0.0, "index": 1},
                                              {"id": "chatcmpl-nope", "reward": 1.0}]}, 404, "unknown_id")]:
        reply = post(body)
        assert reply.status_code == status and reply.json()["error"]["code"] == code, reply.text
    assert len([f for f in records(cfg, "feedback") if f.request_id == answer.id]) == 1  # the refused ones: nothing

    # a restarted server reads the ledger back from the topics: the first reward still counts
    ledger = FeedbackLedger(cfg.serve.feedback_expire_s)
    reader = connect(cfg.kafka).source()
    ledger.load(reader, cfg.topic("served"), cfg.topic("feedback"))
    reader.close()
    with pytest.raises(FeedbackRefused, match="already has its reward"):
        ledger.reserve([(answer.id, 0)])

    assert post({"feedback": [{"id": answer.id, "reward": 0.0, "index": 1}]}).json()["accepted"] == 1
    joiner = Joiner(cfg.serve, topics=RunTopics.of(cfg), kafka=cfg.kafka)
    try:
        groups = []
        wait_until(lambda: any(g.group_id.endswith(answer.id) for g in groups), timeout=30, interval=0,
                   what="the answer's group joined with its feedback", between=lambda: groups.extend(joiner.step()))
    finally:
        joiner.close()
    [group] = [g for g in groups if g.group_id.endswith(answer.id)]
    assert [s.reward for s in group.samples] == [1.0, 0.0]
    assert group.samples[0].reward_components == {"thumbs": 1.0, "feedback": 1.0}
    record = served_record(cfg, answer.id)
    assert list(group.samples[1].response_tokens) == list(record.choices[1].response_tokens)
    assert [f for f in records(cfg, "feedback") if isinstance(f, Feedback) and f.request_id == answer.id]


def test_a_published_version_is_served_next(served, client, tiny_model):
    cfg, url, service = served
    store = WeightStore.for_sync(cfg.sync, cfg.run_dir)
    store.publish(1, [{k: v + 0.05 for k, v in iter_safetensors(tiny_model)}], tiny_model)
    wait_until(lambda: httpx.get(url + "/health").json()["policy_version"] == 1, timeout=20, interval=0.2,
               what="the server to load version 1")
    answer = client.chat.completions.create(model=cfg.run.name, messages=MESSAGES, max_tokens=2)
    assert answer.model_extra["policy_version"] == 1 and served_record(cfg, answer.id).policy_version == 1
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [cfg.run.name]
    metrics = httpx.get(url + "/metrics").text
    assert "rft_serve_completions_recorded_total" in metrics and "rft_serve_weights_version 1.0" in metrics
