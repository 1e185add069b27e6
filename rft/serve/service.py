"""The state of `rft serve` (`ServeService`): the engine thread (rft/serve/engine_thread.py), one tokenizer thread,
the Kafka sink its records go through, the feedback ledger (rft/serve/ledger.py) and its Prometheus metrics. The
HTTP app (rft/serve/app.py) calls `complete` and `feedback`; `close` stops the threads.

Contracts:
- Limits (serve.*): n x max_tokens over max_request_tokens 400, max_queue requests already waiting (for the
  tokenizer thread or for the engine) 429 with Retry-After, not generated within request_timeout_s 504 (nothing
  recorded).
- Every completion is recorded before it is answered: one `ServedCompletion` on `<prefix>.served` (key = request id,
  the response's `id`), acknowledged by the broker; a request whose record is not acknowledged gets a 503 and no
  answer. Accepted feedback is likewise one acknowledged `Feedback` on `<prefix>.feedback` before the 200, or
  none of a batch. The joiner (rft/serve/joiner.py) turns them into experience groups.
- The answer is the OpenAI `chat.completion` shape plus `policy_version` (the weights version that generated every
  choice; also `system_fingerprint: rft-v<version>`).
- An adapter's traffic (`serve.adapters`) is answered, not recorded: it trains no run here (each run's own
  `rft serve` records its traffic), and feedback on it is refused as unknown (404).
- A request with images (a vision-language model; rft/serve/requests.py) is answered, not recorded, until the served
  record carries its images (without them the prompt's image tokens could not be trained on); feedback on it is
  refused as unknown (404).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rft.schema import RewardRange, ServedChoice, ServedCompletion
from rft.serve.engine_thread import EngineWorker, Served
from rft.serve.feedback import parse_feedback
from rft.serve.ledger import FeedbackLedger, FeedbackRefused
from rft.serve.requests import ApiError, ChatRequest, ImageLimits, parse_chat_request, prompt_key
from rft.transport.run_topics import RunTopics

if TYPE_CHECKING:
    from rft.serve.config import ServeConfig
    from rft.transport import RecordSink


class Metrics:
    """The endpoint's Prometheus series (`/metrics`), in a registry of its own."""

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
                 limits: Limits = Limits(), ack_timeout_s: float = 30.0,
                 images: ImageLimits | None = None, render_images: Callable[[list, tuple], Any] | None = None):
        """`images`: the image parts a request may carry (none: a text model); `render_images(messages, images)`
        renders such a request to an ImagePrompt on the tokenizer thread (rft.serve.requests.image_renderer)."""
        self.worker, self.sink, self.ledger, self.topics = worker, sink, ledger, topics
        self.rewards = rewards  # the feedback rewards accepted (run.reward_min / reward_max); 400 otherwise
        self.model_name, self.max_tokens, self.ack_timeout_s = model_name, max_tokens, ack_timeout_s
        self.tokenize, self.limits = tokenize, limits
        self.images, self.render_images = images or ImageLimits(), render_images
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="serve-tokenize")
        self._tokenizing = 0  # requests admitted and not yet submitted to the engine thread (event loop only)
        self.metrics = Metrics()
        self.started = int(time.time())

    def close(self) -> None:
        """Stop the engine and tokenizer threads and close the sink."""
        self.worker.stop()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        self.sink.close()

    def waiting(self) -> int:
        """Requests admitted and not yet taken by the engine thread: those waiting for (or in) the tokenizer thread
        and those queued for the engine."""
        return self._tokenizing + self.worker.waiting()

    async def _generate(self, request: ChatRequest, received: float) -> Served:
        """The request tokenized (tokenizer thread), queued and generated, within serve.request_timeout_s of
        `received` (time.time()): 504 past it, 429 with Retry-After when max_queue requests already wait
        (`waiting`)."""
        s, limits = request.sampling, self.limits
        if s.n * s.max_tokens > limits.max_request_tokens:
            raise ApiError(400, f"n x max_tokens = {s.n} x {s.max_tokens} = {s.n * s.max_tokens} is over this "
                           f"server's limit of {limits.max_request_tokens} tokens per request "
                           "(serve.max_request_tokens)", param="n")
        waiting = self.waiting()
        if waiting >= limits.max_queue:
            calls = -(-waiting // max(1, self.worker.max_batch))
            retry = max(1, round(calls * self.worker.last_call_s))
            raise ApiError(429, f"{waiting} requests are waiting for the tokenizer or the engine (serve.max_queue = "
                           f"{limits.max_queue}); retry after {retry} s", code="rate_limit_exceeded",
                           kind="rate_limit_error", headers={"Retry-After": str(retry)})
        loop = asyncio.get_running_loop()
        deadline = received + limits.request_timeout_s
        try:
            self._tokenizing += 1
            try:
                if request.images and self.render_images is not None:
                    rendering = loop.run_in_executor(self._tokenizer_thread, self.render_images, request.messages,
                                                     request.images)
                else:
                    rendering = loop.run_in_executor(self._tokenizer_thread, self.tokenize, request.messages)
                prompt = await asyncio.wait_for(rendering, max(0.0, deadline - time.time()))
                generated = self.worker.submit(prompt, s, request.stream, request.adapter)
            finally:
                self._tokenizing -= 1
            return await asyncio.wait_for(asyncio.wrap_future(generated), max(0.0, deadline - time.time()))
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
                                     adapters=tuple(self.worker.adapters), images=self.images)
        served = await self._generate(request, received)
        completions = served.generation.completions
        version = min(c.weights_version for c in completions)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if request.adapter is not None or request.images:  # answered, not recorded (module docstring)
            answer = self._answer(request_id, received, request.adapter or self.model_name, version, served)
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
        """Record the feedback of `body` (rft/serve/feedback.py): all items or none; ApiError as the ledger refuses."""
        records = parse_feedback(body, run_id=self.topics.run, rewards=self.rewards)
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
