"""`rft serve CONFIG [--port P]`: an OpenAI-compatible endpoint whose traffic becomes training data (FastAPI + uvicorn).

Routes:
  POST /v1/chat/completions  messages, model, temperature, top_p, max_tokens (or max_completion_tokens), n, stop,
                             stream (server-sent `chat.completion.chunk`s, then `data: [DONE]`). The answer is the
                             OpenAI shape plus `policy_version` (the weights version that generated every choice; also
                             `system_fingerprint: rft-v<version>` and the `X-RFT-Policy-Version` header).
  POST /v1/feedback          {"id", "reward", "components"?: {name: float}, "index"?: choice (0)}, or
                             {"feedback": [...]} (all recorded or none). 200 {"object": "feedback", "accepted": k}.
  GET  /v1/models            the models served: `serve.model_name` (else run.name), then each `serve.adapters` name
  GET  /health               {"status": "ok", "policy_version", "model"}
  GET  /metrics              Prometheus: requests, latency, completions recorded, feedback, weights version
Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}` with a 4xx status (5xx when the
engine or the broker failed): malformed JSON or fields 400, unknown model 404, prompt over model.max_prompt_len 400
(`context_length_exceeded`), feedback refused as rft/serve/ledger.py says (400/404/409/410). Before any route:
a Host not allowed 400, no valid bearer key 401 (when keys are set: serve.api_key_env / api_key_file, required
beyond loopback), a body that is not `application/json` 415 (rft/observability/access.py). Limits (serve.*): a body over
max_body_bytes 413, n x max_tokens over max_request_tokens 400, max_queue requests already waiting 429 with
Retry-After, not generated within request_timeout_s 504 (nothing recorded).

Contracts:
- Messages are tokenized on one tokenizer thread (ServeService), never on the engine's: the engine is the
  explorers' (`explorer.engine` and its settings; rft/engine/), owned by one thread (`EngineWorker`) that
  generates up to `serve.max_batch` waiting requests per call and reloads the newest weights in place (the weight
  store's LATEST or a `weights` announcement, rft/weights/subscriber.py) only between calls, so
  all choices of a request come from one version. Messages are rendered as the explorers render prompts: with
  `model.chat_template: true` by the tokenizer's chat template (the whole conversation, `model.system_prompt` first
  when set and the request has no system message; rft/text/chat.py), else the messages' contents joined by newlines as
  plain text with the tokenizer's special tokens.
- Every completion is recorded before it is answered: one `ServedCompletion` on `<prefix>.served` (key = request id,
  the response's `id`), acknowledged by the broker; a request whose record is not acknowledged gets a 503 and no
  answer. Accepted feedback is likewise one acknowledged `Feedback` on `<prefix>.feedback` before the 200. The joiner
  (rft/serve/joiner.py) turns them into experience groups.
- Several adapters, one base (`serve.adapters`, a LoRA run's name -> its weight store): the request's `model` picks
  the run's own policy or one of them. Each adapter is the newest version of its store (LATEST, checked against the
  manifest), loaded into the same vLLM engine beside the base between calls (rft.engine.VLLMEngine.load_adapter); its
  answers carry that version. Their traffic is answered, not recorded: it trains no run here (each run's own
  `rft serve` records its traffic), and feedback on it is refused as unknown (404).
- Streaming sends the whole completion's text in per-token deltas once it is generated and recorded (the engine
  returns whole completions): the protocol is OpenAI's, the first token's latency is the whole completion's.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import copy
import hashlib
import json
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rft.engine import SamplingSettings, build_engine
from rft.observability.access import Access, AccessConfigError, AccessDenied, allowed_hosts, serve_access
from rft.observability.app_thread import AppThread
from rft.schema import Feedback, RewardRange, ServedChoice, ServedCompletion
from rft.serve import part_config
from rft.serve.ledger import FeedbackLedger, FeedbackRefused
from rft.text.chat import ChatError, encode_messages
from rft.transport import connect
from rft.transport.run_topics import RunTopics
from rft.weights.store import WeightStore
from rft.weights.stores import open_store
from rft.weights.subscriber import WeightUpdates, load_newest_weights

if TYPE_CHECKING:
    from rft.config import Config, ServeConfig
    from rft.engine import Engine, Generation
    from rft.transport import RecordSink, Transport

log = logging.getLogger("rft.serve")

MAX_N = 16
MAX_STOP = 4
REFRESH_S = 0.5  # how often an idle engine thread looks for newer weights


class ApiError(Exception):
    """A request refused with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


# --------------------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    sampling: SamplingSettings
    stream: bool
    adapter: str | None = None  # the `serve.adapters` model the request names; None: the run's own policy


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}: content must be a string or a list of text parts", param=where)


def _number(body: dict, key: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{key}: expected a number, got {json.dumps(value)[:40]}", param=key)
    if value < low or (low_open and value == low) or value > high:
        raise ApiError(400, f"{key}: {value} is out of range ({'(' if low_open else '['}{low}, {high}])", param=key)
    return float(value)


def _integer(body: dict, key: str, default: int, low: int, high: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{key}: expected an integer, got {json.dumps(value)[:40]}", param=key)
    if not low <= value <= high:
        raise ApiError(400, f"{key}: {value} is out of range [{low}, {high}]", param=key)
    return value


def parse_chat_request(body: Any, *, model_name: str, max_tokens: int, adapters: tuple[str, ...] = ()) -> ChatRequest:
    """The request as rft runs it; ApiError (400, or 404 for another model) naming the bad field. `max_tokens`: the
    largest (and default) completion length, model.max_response_len. `adapters`: the other model names served
    (serve.adapters)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name and model not in adapters:
        served = ", ".join(repr(m) for m in (model_name, *adapters))
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served}", param="model",
                       code="model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: required, a non-empty list of {role, content} objects", param="messages")
    rendered = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"{where}: expected an object with a string role", param=where)
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"{where}.role: unknown role {m['role']!r}", param=f"{where}.role")
        rendered.append({"role": "system" if m["role"] == "developer" else m["role"],
                         "content": _text(m.get("content"), f"{where}.content")})
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ApiError(400, f"{key}: must be a positive integer, got {json.dumps(limit)[:40]}", param=key)
    if limit is not None and limit > max_tokens:
        raise ApiError(400, f"{key}: {limit} is over this model's limit of {max_tokens} tokens "
                       "(model.max_response_len)", param=key)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop: a string or a list of at most {MAX_STOP} non-empty strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream: expected true or false", param="stream")
    sampling = SamplingSettings(n=_integer(body, "n", 1, 1, MAX_N),
                                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                                max_tokens=limit or max_tokens, stop=tuple(stops))
    return ChatRequest(rendered, sampling, stream, adapter=model if model in adapters else None)


def prompt_key(prompt_tokens: list[int]) -> str:
    """The prompt's name for grouping: a hash of its token ids."""
    return hashlib.sha1(np.asarray(prompt_tokens, dtype="<i4").tobytes()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# The engine thread


@dataclass
class _Job:
    prompt: list[int]
    sampling: SamplingSettings
    stream: bool
    future: concurrent.futures.Future
    adapter: str | None = None


@dataclass
class Served:
    """One request's result: the prompt ids, the generation, and (streaming) each choice's text deltas."""
    prompt_tokens: list[int]
    generation: Generation
    deltas: list[list[str]]


class EngineWorker:
    """The one thread that owns the engine (module docstring); it gets token ids, never text (requests are
    tokenized before they are submitted, off this thread). `newest()` names the newest trusted weights
    (WeightUpdates.newest), None: never reload. `adapters`: name -> newest(above) of each served adapter's store
    (serve.adapters; a vLLM engine with LoRA). `start()` builds the engine with `factory()` in the thread and waits
    for it. A submitted job whose future is cancelled before the thread takes it is skipped (its deadline passed);
    one cancelled later is generated and its result dropped."""

    def __init__(self, factory: Callable[[], Engine], *, newest: Callable[[int], Any] | None = None,
                 max_batch: int = 16, adapters: dict[str, Callable[[int], Any]] | None = None):
        self.factory, self.newest, self.max_batch = factory, newest, max_batch
        self.adapters = adapters or {}
        self.adapter_versions: dict[str, int] = {}  # adapter name -> the version loaded
        self.engine: Engine | None = None
        self.queue: queue.Queue[_Job | None] = queue.Queue()
        self.reloads = 0
        self.last_call_s = 0.0  # how long the last engine call took (seconds)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def waiting(self) -> int:
        """Jobs submitted and not yet taken by the engine thread."""
        return self.queue.qsize()

    @property
    def version(self) -> int:
        return self.engine.weights_version if self.engine is not None else -1

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def submit(self, prompt: list[int], sampling: SamplingSettings, stream: bool,
               adapter: str | None = None) -> concurrent.futures.Future:
        """Queue one request (`prompt`: token ids; `adapter`: the served adapter's name, None: the run's own
        weights); the future holds its `Served`, or an ApiError."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.queue.put(_Job(prompt, sampling, stream, future, adapter))
        return future

    def stop(self) -> None:
        """End the thread (after the jobs queued before this call); a no-op for a worker never started."""
        if self._thread.is_alive():
            self.queue.put(None)
            self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            self.engine = self.factory()
            self._refresh()
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                try:
                    first = self.queue.get(timeout=REFRESH_S)
                except queue.Empty:
                    self._refresh()
                    continue
                if first is None:
                    return
                jobs = [first]
                while len(jobs) < self.max_batch:
                    try:
                        job = self.queue.get_nowait()
                    except queue.Empty:
                        break
                    if job is None:
                        self.queue.put(None)
                        break
                    jobs.append(job)
                self._refresh()
                self._generate(jobs)
        finally:
            self.engine.close()

    def _refresh(self) -> None:
        for name, newest in self.adapters.items():
            found = newest(self.adapter_versions.get(name, -1))
            if found is not None:
                version, path = found
                try:
                    self.engine.load_adapter(name, path, version)
                    self.adapter_versions[name] = version
                except Exception as e:  # noqa: BLE001  (keeps serving the version it has; tried again next time)
                    log.warning("adapter %s version %d from %s not loaded: %s", name, version, path, e)
        if self.newest is None:
            return
        try:
            if load_newest_weights(self.engine, lambda: self.newest(self.engine.weights_version)) is not None:
                self.reloads += 1
        except RuntimeError as e:  # keeps serving the weights it has; tried again next time
            log.warning("%s", e)

    def _generate(self, jobs: list[_Job]) -> None:
        runnable: dict[tuple[SamplingSettings, str | None], list[tuple[_Job, list[int]]]] = {}
        for job in jobs:
            if not job.future.set_running_or_notify_cancel():  # cancelled while it waited (its deadline passed)
                continue
            if job.adapter is not None and job.adapter not in self.adapter_versions:
                job.future.set_exception(ApiError(
                    503, f"the model {job.adapter!r} has no adapter version yet (its weight store has none, or none "
                    "passed the checks); retry later", kind="server_error"))
                continue
            runnable.setdefault((job.sampling, job.adapter), []).append((job, job.prompt))
        started = time.monotonic()
        for (sampling, adapter), batch in runnable.items():
            prompts = [ids for _, ids in batch]
            try:
                generations = (self.engine.generate(prompts, sampling) if adapter is None
                               else self.engine.generate(prompts, sampling, adapter=adapter))
            except Exception as e:  # the engine failed: every request of the call gets a 500
                log.exception("generation failed")
                for job, _ in batch:
                    job.future.set_exception(ApiError(500, f"generation failed: {e}", kind="server_error"))
                continue
            for (job, ids), generation in zip(batch, generations):
                deltas = [self._deltas(c) for c in generation.completions] if job.stream else []
                job.future.set_result(Served(ids, generation, deltas))
        self.last_call_s = time.monotonic() - started

    def _deltas(self, completion) -> list[str]:
        """Per-token text deltas that add up to the completion's text."""
        pieces, sent = [], ""
        for k in range(1, len(completion.token_ids) + 1):
            text = self.engine.decode(completion.token_ids[:k])[:len(completion.text)]
            if len(text) > len(sent) and completion.text.startswith(text):
                pieces.append(text[len(sent):])
                sent = text
        if sent != completion.text:
            pieces.append(completion.text[len(sent):])
        return pieces


def renderer(cfg: Config) -> Callable[[Any, list], list[int]]:
    """How messages become prompt ids (module docstring), refusing prompts over model.max_prompt_len."""
    model = cfg.model

    def render(tokenizer, messages: list[dict[str, str]]) -> list[int]:
        if model.chat_template:
            if model.system_prompt and not any(m["role"] == "system" for m in messages):
                messages = [{"role": "system", "content": model.system_prompt}] + messages
            try:
                ids = encode_messages(tokenizer, messages)
            except ChatError as e:
                raise ApiError(500, str(e), kind="server_error") from None
        else:
            ids = list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])
        if not ids:
            raise ApiError(400, "messages: the prompt is empty after tokenization", param="messages")
        if len(ids) > model.max_prompt_len:
            raise ApiError(400, f"messages: the prompt is {len(ids)} tokens, over this model's limit of "
                           f"{model.max_prompt_len} (model.max_prompt_len)", param="messages",
                           code="context_length_exceeded")
        return ids
    return render


# --------------------------------------------------------------------------------------------------
# The service


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("rft_serve_requests", "chat completion requests by HTTP status", ["status"],
                                registry=self.registry)
        self.recorded = Counter("rft_serve_completions_recorded", "choices recorded on the served topic",
                                registry=self.registry)
        self.feedback = Counter("rft_serve_feedback", "feedback items by result", ["result"], registry=self.registry)
        self.latency = Histogram("rft_serve_request_seconds", "chat completion latency (received to answered)",
                                 registry=self.registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.version = Gauge("rft_serve_weights_version", "weights version the engine holds", registry=self.registry)

    def text(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)


@dataclass(frozen=True)
class Limits:
    """What one request may ask (serve.max_body_bytes, max_request_tokens, max_queue, request_timeout_s)."""
    max_body_bytes: int = 1 << 20
    max_request_tokens: int = 16384  # n x max_tokens
    max_queue: int = 64  # requests waiting for the engine thread
    request_timeout_s: float = 300.0  # from received to generated

    @classmethod
    def of(cls, serve: ServeConfig) -> Limits:
        return cls(serve.max_body_bytes, serve.max_request_tokens, serve.max_queue, serve.request_timeout_s)


class ServeService:
    """The endpoint's state: the engine thread, the Kafka sink its records go through, the feedback ledger, and the
    one tokenizer thread: `tokenize(messages) -> ids` (raising ApiError for a prompt it refuses) runs there, one
    request at a time, never on the engine's thread."""

    def __init__(self, *, worker: EngineWorker, sink: RecordSink, ledger: FeedbackLedger, topics: RunTopics,
                 model_name: str, max_tokens: int, tokenize: Callable[[list], list[int]], rewards: RewardRange,
                 limits: Limits = Limits(), ack_timeout_s: float = 30.0):
        self.worker, self.sink, self.ledger, self.topics = worker, sink, ledger, topics
        self.rewards = rewards  # the feedback rewards accepted (explorer.reward_min / reward_max); 400 otherwise
        self.model_name, self.max_tokens, self.ack_timeout_s = model_name, max_tokens, ack_timeout_s
        self.tokenize, self.limits = tokenize, limits
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="serve-tokenize")
        self.metrics = Metrics()
        self.started = int(time.time())

    def close(self) -> None:
        """Stop the engine and tokenizer threads and close the sink."""
        self.worker.stop()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        self.sink.close()

    async def _generate(self, request: ChatRequest, received: float) -> Served:
        """The request tokenized (tokenizer thread), queued and generated, within serve.request_timeout_s of
        `received` (time.time()): 504 past it, 429 with Retry-After when max_queue requests already wait."""
        s, limits = request.sampling, self.limits
        if s.n * s.max_tokens > limits.max_request_tokens:
            raise ApiError(400, f"n x max_tokens = {s.n} x {s.max_tokens} = {s.n * s.max_tokens} is over this "
                           f"server's limit of {limits.max_request_tokens} tokens per request "
                           "(serve.max_request_tokens)", param="n")
        waiting = self.worker.waiting()
        if waiting >= limits.max_queue:
            calls = -(-waiting // max(1, self.worker.max_batch))
            retry = max(1, round(calls * self.worker.last_call_s))
            raise ApiError(429, f"{waiting} requests are waiting for the engine (serve.max_queue = "
                           f"{limits.max_queue}); retry after {retry} s", code="rate_limit_exceeded",
                           kind="rate_limit_error", headers={"Retry-After": str(retry)})
        loop = asyncio.get_running_loop()
        deadline = received + limits.request_timeout_s
        try:
            prompt = await asyncio.wait_for(loop.run_in_executor(self._tokenizer_thread, self.tokenize,
                                                                 request.messages), max(0.0, deadline - time.time()))
            return await asyncio.wait_for(asyncio.wrap_future(self.worker.submit(prompt, s, request.stream, request.adapter)),
                                          max(0.0, deadline - time.time()))
        except asyncio.TimeoutError:
            raise ApiError(504, f"the request was not generated within serve.request_timeout_s = "
                           f"{limits.request_timeout_s:g} s (nothing was recorded); retry later", code="timeout",
                           kind="server_error") from None

    async def record(self, record: Any, key: str) -> None:
        """Send one record and wait for the broker's ack; ApiError 503 when it is not taken."""
        try:
            future = self.sink.send_record(self.topics.served if isinstance(record, ServedCompletion)
                                           else self.topics.feedback, record, key=key)
            await asyncio.to_thread(future.get, self.ack_timeout_s)
        except Exception as e:
            raise ApiError(503, f"the record could not be stored ({type(e).__name__}: {e}); nothing was kept, retry",
                           kind="server_error") from None

    async def complete(self, body: Any) -> dict | tuple[dict, list[list[str]]]:
        received = time.time()
        request = parse_chat_request(body, model_name=self.model_name, max_tokens=self.max_tokens,
                                     adapters=tuple(self.worker.adapters))
        served = await self._generate(request, received)
        completions = served.generation.completions
        version = min(c.weights_version for c in completions)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if request.adapter is not None:  # another run's adapter: answered, not recorded (module docstring)
            answer = self._answer(request_id, received, request.adapter, version, served)
            return (answer, served.deltas) if request.stream else answer
        s = request.sampling
        record = ServedCompletion(
            run_id=self.topics.run, request_id=request_id, prompt_key=prompt_key(served.prompt_tokens),
            prompt_tokens=np.asarray(served.prompt_tokens, dtype=np.int32),
            choices=[ServedChoice(i, np.asarray(c.token_ids, dtype=np.int32), np.asarray(c.logprobs, dtype=np.float32),
                                  c.finish_reason) for i, c in enumerate(completions)],
            policy_version=version, model=self.model_name, created_at=received, finished_at=time.time(),
            metadata={"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens, "n": s.n,
                      "stop": list(s.stop)})
        await self.record(record, request_id)
        self.ledger.served(request_id, len(completions), received)
        self.metrics.recorded.inc(len(completions))
        self.metrics.version.set(version)
        answer = self._answer(request_id, received, self.model_name, version, served)
        return (answer, served.deltas) if request.stream else answer

    @staticmethod
    def _answer(request_id: str, received: float, model: str, version: int, served: Served) -> dict:
        """The OpenAI chat.completion body of a served request."""
        completions = served.generation.completions
        return {
            "id": request_id, "object": "chat.completion", "created": int(received), "model": model,
            "system_fingerprint": f"rft-v{version}", "policy_version": version,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                         "finish_reason": "stop" if c.finish_reason == "stop" else "length"}
                        for i, c in enumerate(completions)],
            "usage": {"prompt_tokens": len(served.prompt_tokens),
                      "completion_tokens": sum(len(c.token_ids) for c in completions),
                      "total_tokens": len(served.prompt_tokens) + sum(len(c.token_ids) for c in completions)},
        }

    async def feedback(self, body: Any) -> dict:
        items = body.get("feedback") if isinstance(body, dict) and "feedback" in body else [body]
        if not isinstance(items, list) or not items:
            raise ApiError(400, "feedback: a non-empty list of {id, reward, components?, index?} objects",
                           param="feedback")
        records = [self._feedback_record(item, i if len(items) > 1 else None) for i, item in enumerate(items)]
        keys = [(r.request_id, r.index) for r in records]
        try:
            self.ledger.reserve(keys)
        except FeedbackRefused as e:
            self.metrics.feedback.labels(e.code).inc(len(records))
            raise ApiError(e.status, str(e), param="id", code=e.code) from None
        try:
            for r in records:
                await self.record(r, r.request_id)
        except ApiError:
            self.ledger.release(keys)
            raise
        self.metrics.feedback.labels("accepted").inc(len(records))
        return {"object": "feedback", "accepted": len(records), "ids": [r.request_id for r in records]}

    def _feedback_record(self, item: Any, position: int | None) -> Feedback:
        where = "feedback" if position is None else f"feedback[{position}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where}: expected an object with id and reward", param=where)
        rid, reward, index = item.get("id"), item.get("reward"), item.get("index", 0)
        if not isinstance(rid, str) or not rid:
            raise ApiError(400, f"{where}.id: required, the completion's id", param=f"{where}.id")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not np.isfinite(reward):
            raise ApiError(400, f"{where}.reward: required, a finite number", param=f"{where}.reward")
        if problem := self.rewards.problem(reward):
            raise ApiError(400, f"{where}.reward: {problem}", param=f"{where}.reward")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ApiError(400, f"{where}.index: a choice index >= 0", param=f"{where}.index")
        components = item.get("components", {})
        if not isinstance(components, dict) or not all(
                isinstance(k, str) and not isinstance(v, bool) and isinstance(v, (int, float)) and np.isfinite(v)
                for k, v in components.items()):
            raise ApiError(400, f"{where}.components: an object of finite numbers", param=f"{where}.components")
        return Feedback(run_id=self.topics.run, request_id=rid, reward=float(reward), index=index,
                        components={k: float(v) for k, v in components.items()})


def create_app(service: ServeService, access: Access | None = None) -> FastAPI:
    """The app over `service` (which the caller starts and closes). Every route first passes `access`'s checks
    (rft.observability.access: Host, bearer key, JSON only; refused with an OpenAI-style error body); None: no key, loopback
    Host names only."""
    access = access or Access(frozenset(), allowed_hosts([], "127.0.0.1"))
    app = FastAPI(title="rft serve", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[access.dependency()])

    @app.exception_handler(AccessDenied)
    async def denied(request: Request, e: AccessDenied) -> JSONResponse:
        return ApiError(e.status, str(e), code=e.code, headers=e.headers).response()

    async def json_body(request: Request) -> Any:
        """The body parsed as JSON; 413 past serve.max_body_bytes (read no further than that), 400 if not JSON."""
        limit = service.limits.max_body_bytes
        too_long = ApiError(413, f"the request body is over serve.max_body_bytes = {limit} bytes",
                            code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_long
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_long
        try:
            return json.loads(body)
        except ValueError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        started = time.monotonic()
        try:
            result = await service.complete(await json_body(request))
        except ApiError as e:
            service.metrics.requests.labels(str(e.status)).inc()
            return e.response()
        service.metrics.requests.labels("200").inc()
        service.metrics.latency.observe(time.monotonic() - started)
        if isinstance(result, dict):
            return JSONResponse(result, headers={"X-RFT-Policy-Version": str(result["policy_version"])})
        answer, deltas = result
        return StreamingResponse(_chunks(answer, deltas), media_type="text/event-stream",
                                 headers={"X-RFT-Policy-Version": str(answer["policy_version"]),
                                          "Cache-Control": "no-cache"})

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> JSONResponse:
        try:
            return JSONResponse(await service.feedback(await json_body(request)))
        except ApiError as e:
            return e.response()

    @app.get("/v1/models")
    def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model",
                                                         "created": service.started, "owned_by": "rft"}
                                                        for name in (service.model_name, *service.worker.adapters)]})

    @app.get("/health")
    def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "model": service.model_name, "policy_version": service.worker.version})

    @app.get("/metrics")
    def metrics() -> Response:
        service.metrics.version.set(service.worker.version)
        return Response(service.metrics.text(), media_type="text/plain; version=0.0.4")

    return app


def _chunks(answer: dict, deltas: list[list[str]]):
    """The streamed form of `answer`: per choice a role chunk, its deltas, a finish chunk; then [DONE]."""
    head = {k: answer[k] for k in ("id", "created", "model", "system_fingerprint", "policy_version")}
    head["object"] = "chat.completion.chunk"

    def chunk(index: int, delta: dict, finish: str | None) -> str:
        return "data: " + json.dumps({**head, "choices": [{"index": index, "delta": delta, "logprobs": None,
                                                           "finish_reason": finish}]}) + "\n\n"

    for choice, pieces in zip(answer["choices"], deltas):
        yield chunk(choice["index"], {"role": "assistant", "content": ""}, None)
        for piece in pieces:
            yield chunk(choice["index"], {"content": piece}, None)
        yield chunk(choice["index"], {}, choice["finish_reason"])
    yield "data: [DONE]\n\n"


# --------------------------------------------------------------------------------------------------
# Composition and command line


def build_service(cfg: Config, *, transport: Transport | None = None, engine_factory=None) -> ServeService:
    """The service `cfg` describes, its engine started (`engine_factory` defaults to the explorers' `build_engine`)
    with the newest weights of the run's store, its ledger read back from the topics."""
    transport = transport or connect(cfg.kafka)
    topics = RunTopics.of(cfg)
    admin = transport.admin()
    try:
        admin.create_topics([topics.served, topics.feedback, topics.control, topics.dead_letter])
    finally:
        admin.close()
    control = transport.source(client_id="serve-control")
    control.assign([topics.control])
    control.seek(control.end_offsets(topics.control))
    updates = WeightUpdates(open_store(cfg.sync, cfg.run_dir), control, verify=cfg.sync.verify)
    worker = EngineWorker(engine_factory or (lambda: build_engine(cfg.explorer, cfg.model, seed=cfg.run.seed,
                                                                  max_loras=1 + len(cfg.serve.adapters))),
                          newest=lambda above: updates.newest(above=above), max_batch=cfg.serve.max_batch,
                          adapters=adapter_stores(cfg))
    ledger = FeedbackLedger(cfg.serve.feedback_expire_s)
    reader = transport.source(client_id="serve-ledger")
    try:
        loaded = ledger.load(reader, topics.served, topics.feedback)
    finally:
        reader.close()
    log.info("ledger: %d served / feedback records read back", loaded)
    worker.start()
    render, tokenizer = renderer(cfg), _own_copy(worker.engine.tokenizer)
    return ServeService(worker=worker, sink=transport.sink(client_id="serve"), ledger=ledger, topics=topics,
                        model_name=cfg.serve.model_name or cfg.run.name, max_tokens=cfg.model.max_response_len,
                        tokenize=lambda messages: render(tokenizer, messages), limits=Limits.of(cfg.serve),
                        rewards=RewardRange.of(cfg.explorer),
                        ack_timeout_s=cfg.kafka.request_timeout_ms / 1000)


def _own_copy(tokenizer):
    """A copy of the engine's tokenizer for the tokenizer thread (a fast tokenizer is not meant to be shared between
    threads); the engine's own where it cannot be copied (then two threads use it, which encoding tolerates)."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception as e:  # noqa: BLE001 - any copy failure: share it
        log.info("tokenizer not copied (%s: %s): the tokenizer thread shares the engine's", type(e).__name__, e)
        return tokenizer


class _NoAnnouncements:
    """The control source of another run's store: serve follows its LATEST only."""

    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list:
        return []

    def close(self) -> None:
        pass


def adapter_stores(cfg: Config) -> dict[str, Callable[[int], Any]]:
    """`serve.adapters` as name -> newest(above): the newest checked version of that run's weight store."""
    stores = {}
    for name, root in cfg.serve.adapters.items():
        updates = WeightUpdates(WeightStore(root), _NoAnnouncements(), verify=cfg.sync.verify)
        stores[name] = lambda above, updates=updates: updates.newest(above=above)
    return stores


class ServerThread(AppThread):
    """`create_app(service, access)` under uvicorn in a thread of this process (tests, `rft bench serve`): `url` once
    `start()` returns; `stop()` ends it (the service is the caller's to close)."""

    def __init__(self, service: ServeService, *, host: str = "127.0.0.1", port: int = 0,
                 access: Access | None = None):
        super().__init__(create_app(service, access), host=host, port=port)


def main(argv: list[str]) -> int:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--port", type=int, default=None, help="TCP port (default: serve.port)")
        parser.add_argument("--host", default=None, help="address to listen on (default: serve.host)")

    cfg, args = part_config("rft serve", __doc__.split("\n")[0], argv, arguments)
    import uvicorn

    host, port = args.host or cfg.serve.host, args.port if args.port is not None else cfg.serve.port
    try:
        access = serve_access(cfg.serve, host)
    except AccessConfigError as e:
        print(f"rft serve: {e}", file=sys.stderr)
        return 2
    service = build_service(cfg)
    try:
        print(f"rft serve: http://{host}:{port}/v1 (model {service.model_name!r}, weights version "
              f"{service.worker.version}, {'a key required' if access.keys else 'no key (loopback)'})", flush=True)
        uvicorn.run(create_app(service, access), host=host, port=port, log_level="warning",
                    timeout_graceful_shutdown=5)
    except OSError as e:
        print(f"rft serve: cannot serve on {host}:{port}: {e}", file=sys.stderr)
        return 1
    finally:
        service.close()
    return 0
