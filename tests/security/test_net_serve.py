"""Attacks on `rft serve` over real HTTP (uvicorn in this process, a real broker, the tiny model): without its key a
request is refused (401) and with it the official `openai` client works; a Host that is not the server's (DNS
rebinding) is refused; a cross-site "simple" POST (text/plain) is refused (415) and records nothing; the limits hold
(body size 413, n x max_tokens 400, a full queue 429 with Retry-After, a deadline 504), the requests waiting for the
tokenizer counted in the queue; prompts are tokenized off the engine's thread; a long streamed answer costs the
engine thread O(tokens) decoding, not O(tokens^2); and `rft serve` beyond loopback without a key refuses to start."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from transformers import AutoTokenizer

from rft.engine import Completion
from rft.observability.access import Access, AccessConfigError, allowed_hosts, serve_access
from rft.processes import free_port
from rft.run.config import config_from_dict
from rft.schema import RewardRange
from rft.serve.app import ServerThread
from rft.serve.config import ServeConfig
from rft.serve.engine_thread import EngineWorker, text_deltas
from rft.serve.ledger import FeedbackLedger
from rft.serve.requests import renderer
from rft.serve.server import build_service
from rft.serve.service import Limits, ServeService
from rft.transport import connect
from rft.transport.run_topics import RunTopics
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration]

KEY = "k-" + "0123456789abcdef" * 2
MESSAGES = [{"role": "user", "content": ":7"}]
REPO_ROOT = Path(__file__).resolve().parents[2]


def serve_config(tmp, tiny_model, broker, **serve):
    return config_from_dict({
        "run": {"name": f"sec-{int(time.time() * 1000) % 10**8}", "mode": "serve", "output_dir": str(tmp / "runs")},
        "model": {"path": str(tiny_model), "max_prompt_len": 32, "max_response_len": 8},
        "kafka": {"bootstrap_servers": broker.bootstrap_servers, "partitions": 2},
        "explorer": {"engine": "transformers"},
        "serve": {"max_body_bytes": 4096, "max_request_tokens": 16, **serve},
        "sync": {"weight_store": str(tmp / "store")},
    })


@pytest.fixture(scope="module")
def keyed(broker, tiny_model, tmp_path_factory):
    """(config, URL, service) of a server that requires KEY."""
    cfg = serve_config(tmp_path_factory.mktemp("keyed"), tiny_model, broker)
    service = build_service(cfg)
    thread = ServerThread(service, access=Access(frozenset({KEY}), allowed_hosts([], "127.0.0.1"))).start()
    yield cfg, thread.url, service
    thread.stop()
    service.close()


def post(url: str, body, *, key: str | None = KEY, **headers) -> httpx.Response:
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    return httpx.post(url + "/v1/chat/completions", content=body, headers=headers, timeout=30)


def test_without_the_key_nothing_is_served_and_the_openai_client_works_with_it(keyed):
    cfg, url, _ = keyed
    for key in (None, "wrong-" + KEY):
        reply = post(url, {"messages": MESSAGES}, key=key)
        assert reply.status_code == 401 and reply.headers["WWW-Authenticate"] == "Bearer"
        assert reply.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(url + "/metrics", timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).chat.completions.create(
            model=cfg.run.name, messages=MESSAGES, max_tokens=2)
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    answer = client.chat.completions.create(model=cfg.run.name, messages=MESSAGES, max_tokens=2)
    assert answer.choices[0].message.role == "assistant"
    assert [m.id for m in client.models.list()] == [cfg.run.name]


def test_a_rebound_host_name_is_refused(keyed):
    _, url, _ = keyed
    reply = post(url, {"messages": MESSAGES}, Host="attacker.example:8000")
    assert reply.status_code == 400 and "attacker.example" in reply.json()["error"]["message"]
    assert post(url, {"messages": MESSAGES, "max_tokens": 1}, Host="localhost").status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_a_cross_site_simple_post_is_refused(keyed, content_type):
    _, url, _ = keyed
    headers = {"Content-Type": content_type} if content_type else {}
    reply = post(url, json.dumps({"messages": MESSAGES}).encode(), **headers)
    assert reply.status_code == 415, reply.text
    feedback = httpx.post(url + "/v1/feedback", content=b'{"id": "x", "reward": 1}', timeout=10,
                          headers={"Authorization": f"Bearer {KEY}", **headers})
    assert feedback.status_code == 415


def test_a_body_past_the_limit_is_413_declared_or_streamed(keyed):
    _, url, _ = keyed
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    assert post(url, big).status_code == 413

    def chunks():  # no Content-Length: chunked, so the limit is counted as it arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    reply = httpx.post(url + "/v1/chat/completions", content=chunks(), timeout=30,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert reply.status_code == 413


def test_n_times_max_tokens_past_the_limit_is_400(keyed):
    _, url, _ = keyed
    reply = post(url, {"messages": MESSAGES, "n": 4, "max_tokens": 8})  # 32 > serve.max_request_tokens = 16
    assert reply.status_code == 400 and "max_request_tokens" in reply.json()["error"]["message"]
    assert post(url, {"messages": MESSAGES, "n": 2, "max_tokens": 8}).status_code == 200


@pytest.fixture
def stalled(broker, tiny_model, tmp_path):
    """(URL, worker) of a server whose engine thread never runs: requests wait in its queue (max_queue 1) until their
    deadline (1.5 s). The tokenizer is the model's, so prompts are still tokenized and checked."""
    cfg = serve_config(tmp_path, tiny_model, broker)
    worker = EngineWorker(lambda: None, max_batch=1)
    render, tokenizer = renderer(cfg.model), AutoTokenizer.from_pretrained(str(tiny_model))
    transport = connect(cfg.kafka)
    service = ServeService(worker=worker, sink=transport.sink(), ledger=FeedbackLedger(60), topics=RunTopics.of(cfg),
                           model_name=cfg.run.name, max_tokens=8, tokenize=lambda m: render(tokenizer, m),
                           rewards=RewardRange.of(cfg.run), limits=Limits(max_queue=1, request_timeout_s=1.5))
    thread = ServerThread(service).start()
    yield thread.url, worker
    thread.stop()
    service.close()


def test_a_full_queue_is_429_with_retry_after_and_a_deadline_504(stalled):
    url, worker = stalled
    first: dict = {}
    waiter = threading.Thread(target=lambda: first.update(reply=post(url, {"messages": MESSAGES}, key=None)))
    waiter.start()
    wait_until(lambda: worker.waiting() == 1, timeout=20, what="the first request queued")
    second = post(url, {"messages": MESSAGES}, key=None)
    assert second.status_code == 429 and int(second.headers["Retry-After"]) >= 1
    assert second.json()["error"]["type"] == "rate_limit_error"
    waiter.join(timeout=30)
    assert first["reply"].status_code == 504 and first["reply"].json()["error"]["code"] == "timeout"
    assert worker.waiting() == 1  # still queued, but cancelled: the engine thread would skip it
    assert worker.queue.get_nowait().future.cancelled()


@pytest.fixture
def slow_tokenizer(broker, tiny_model, tmp_path):
    """(URL, service, tokenizing, release) of a server (max_queue 1, deadline 3 s) whose tokenizer thread holds each
    prompt until `release` is set; `tokenizing` is set when it has one. The engine thread never runs."""
    cfg = serve_config(tmp_path, tiny_model, broker)
    render, tokenizer = renderer(cfg.model), AutoTokenizer.from_pretrained(str(tiny_model))
    tokenizing, release = threading.Event(), threading.Event()

    def tokenize(messages):
        tokenizing.set()
        release.wait(30)
        return render(tokenizer, messages)

    transport = connect(cfg.kafka)
    service = ServeService(worker=EngineWorker(lambda: None, max_batch=1), sink=transport.sink(),
                           ledger=FeedbackLedger(60), topics=RunTopics.of(cfg), model_name=cfg.run.name, max_tokens=8,
                           tokenize=tokenize, rewards=RewardRange.of(cfg.run),
                           limits=Limits(max_queue=1, request_timeout_s=3))
    thread = ServerThread(service).start()
    yield thread.url, service, tokenizing, release
    release.set()
    thread.stop()
    service.close()


def test_requests_waiting_for_the_tokenizer_count_toward_the_queue(slow_tokenizer):
    """A request held by the tokenizer thread is in flight: with max_queue 1 the next one is 429 at once instead of
    piling up behind the tokenizer (where it would wait, unbounded, for its deadline)."""
    url, service, tokenizing, release = slow_tokenizer
    first: dict = {}
    waiter = threading.Thread(target=lambda: first.update(reply=post(url, {"messages": MESSAGES}, key=None)))
    waiter.start()
    wait_until(tokenizing.is_set, timeout=20, what="the first request in the tokenizer")
    second = post(url, {"messages": MESSAGES}, key=None)
    assert second.status_code == 429, second.text
    assert "tokenizer" in second.json()["error"]["message"] and int(second.headers["Retry-After"]) >= 1
    assert service.waiting() == 1
    release.set()
    waiter.join(timeout=30)
    assert first["reply"].status_code == 504  # tokenized, then queued for an engine thread that never runs
    assert service.waiting() == service.worker.waiting() == 1  # no longer counted as tokenizing


def test_prompts_are_tokenized_off_the_engine_thread(stalled):
    """The engine thread never runs here, yet a prompt over model.max_prompt_len is refused at once."""
    url, _ = stalled
    reply = post(url, {"messages": [{"role": "user", "content": "x" * 60}]}, key=None)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("command", ["serve", "dashboard", "run"])
def test_beyond_loopback_without_a_key_it_refuses_to_start(tmp_path, tiny_model, broker, command):
    """`rft serve --host 0.0.0.0`, `rft dashboard --host 0.0.0.0` and `rft run` whose dashboard would listen on
    0.0.0.0 exit 2 naming what to set, before they start anything."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "refuse", "mode": "serve", "output_dir": str(tmp_path / "runs")},
        "model": {"path": str(tiny_model)}, "kafka": {"bootstrap_servers": broker.bootstrap_servers},
        "monitor": {"dashboard_host": "0.0.0.0", "dashboard_port": free_port()}}))
    env = {k: v for k, v in os.environ.items() if k not in ("RFT_SERVE_API_KEY", "RFT_DASHBOARD_KEY")}
    hosts = ["--host", "0.0.0.0", "--port", str(free_port())] if command != "run" else []
    done = subprocess.run([sys.executable, "-m", "rft.cli", command, str(config), *hosts], capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT, env=env)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "beyond loopback" in done.stderr and "without a key" in done.stderr
    assert not (tmp_path / "runs" / "refuse" / "logs").exists()  # nothing was started


def test_a_short_key_is_refused(monkeypatch):
    monkeypatch.setenv("RFT_SERVE_API_KEY", "secret")
    with pytest.raises(AccessConfigError, match="at least 16"):
        serve_access(ServeConfig(), "127.0.0.1")


class CountingDecoder:
    """A real tokenizer's decode (as the engines' TokenizerMixin.decode), counting the tokens it is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls, self.decoded = tokenizer, 0, 0

    def decode(self, token_ids) -> str:
        self.calls += 1
        self.decoded += len(token_ids)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


CORPUS = ["hello world 你好世界 🙂🎉 ok"] * 20


@pytest.fixture(scope="module")
def tokenizers():
    """Two tokenizers trained here: byte-level BPE (as GPT-2's, Qwen's), which splits multi-byte characters across
    tokens (a prefix can end in a cut character), and SentencePiece BPE (as Llama's), whose decode drops the
    leading space of a window's first token."""
    from tokenizers import ByteLevelBPETokenizer, SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    byte_level, sentence_piece = ByteLevelBPETokenizer(), SentencePieceBPETokenizer()
    byte_level.train_from_iterator(CORPUS, vocab_size=300, min_frequency=1, show_progress=False)
    sentence_piece.train_from_iterator(CORPUS, vocab_size=60, min_frequency=1, show_progress=False)
    return {name: PreTrainedTokenizerFast(tokenizer_object=t._tokenizer)
            for name, t in (("byte-level", byte_level), ("sentencepiece", sentence_piece))}


@pytest.mark.parametrize("kind,text", [("byte-level", "héllo 你好 🙂 wörld, ok " * 150), ("byte-level", "🙂" * 700),
                                       ("byte-level", "plain ascii words " * 120),
                                       ("sentencepiece", "hello 你好 🙂 world ok " * 150)])
def test_a_long_streamed_answer_is_decoded_in_linear_work(tokenizers, kind, text):
    """The engine returns a whole completion; its streamed deltas are cut on the engine thread. Re-decoding every
    prefix costs T^2 / 2 decoded tokens (about 4 million for T = 2,850); the incremental detokenizer's work per
    token is bounded. The deltas still add up to the text, one per token where a token completes characters."""
    tokenizer = tokenizers[kind]
    ids = tokenizer(text)["input_ids"]
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 600 and decoded == text
    counter = CountingDecoder(tokenizer)
    pieces = text_deltas(counter, Completion(ids, [0.0] * len(ids), decoded, "length", 0))
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    assert len(pieces) > len(ids) * 3 / 4, "the deltas must stay per token, not one lump"
    assert counter.decoded <= 8 * len(ids), f"{counter.decoded} tokens decoded for a {len(ids)}-token answer"
    # a stop string cut the text short of what the tokens decode to: the deltas add up to the cut text
    cut = text[: len(text) // 2]
    assert "".join(text_deltas(CountingDecoder(tokenizer), Completion(ids, [0.0] * len(ids), cut, "stop", 0))) == cut
