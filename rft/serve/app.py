"""The HTTP face of `rft serve` (FastAPI): `create_app(service, access)` routes requests to a `ServeService`
(rft/serve/service.py).

Routes:
  POST /v1/chat/completions  messages, model, temperature, top_p, max_tokens (or max_completion_tokens), n, stop,
                             stream (server-sent `chat.completion.chunk`s, then `data: [DONE]`). The answer carries
                             the `X-RFT-Policy-Version` header.
  POST /v1/feedback          {"id", "reward", "components"?, "index"?} or {"feedback": [...]} (rft/serve/feedback.py);
                             200 {"object": "feedback", "accepted": k}.
  GET  /v1/models            the models served: `serve.model_name` (else run.name), then each `serve.adapters` name
  GET  /health               {"status": "ok", "policy_version", "model"}
  GET  /metrics              Prometheus: requests, latency, completions recorded, feedback, weights version
Every error is an OpenAI-style body (rft/serve/requests.py, `ApiError`) with a 4xx status (5xx when the engine or
the broker failed). Before any route (rft/observability/access.py): a Host not allowed 400, no valid bearer key 401
(when keys are set: serve.api_key_env / api_key_file, required beyond loopback), a body that is not
`application/json` 415. A body over serve.max_body_bytes is 413 (read no further), one that is not JSON 400.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rft.observability.access import Access, AccessDenied, allowed_hosts
from rft.observability.app_thread import AppThread
from rft.serve.requests import ApiError
from rft.serve.service import ServeService
from rft.text.openai_api import json_body


def error_response(e: ApiError) -> JSONResponse:
    """`e` as its OpenAI-style body, status and headers."""
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(service: ServeService, access: Access | None = None) -> FastAPI:
    """The app over `service` (which the caller starts and closes). Every route first passes `access`'s checks
    (rft.observability.access: Host, bearer key, JSON only; refused with an OpenAI-style error body); None: no key,
    loopback Host names only."""
    access = access or Access(frozenset(), allowed_hosts([], "127.0.0.1"))
    app = FastAPI(title="rft serve", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[access.dependency()])

    @app.exception_handler(AccessDenied)
    async def denied(request: Request, e: AccessDenied) -> JSONResponse:
        return error_response(ApiError(e.status, str(e), code=e.code, headers=e.headers))

    async def body(request: Request) -> Any:
        return await json_body(request, service.limits.max_body_bytes, "serve.max_body_bytes")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        started = time.monotonic()
        try:
            result = await service.complete(await body(request))
        except ApiError as e:
            service.metrics.requests.labels(str(e.status)).inc()
            return error_response(e)
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
            return JSONResponse(await service.feedback(await body(request)))
        except ApiError as e:
            return error_response(e)

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


def _chunks(answer: dict, deltas: list[list[str]]) -> Iterator[str]:
    """The streamed form of `answer`: per choice a role chunk, its deltas, a finish chunk; then [DONE]."""
    head = {k: answer[k] for k in ("id", "created", "model", "system_fingerprint", "policy_version")}
    head["object"] = "chat.completion.chunk"

    def chunk(index: int, delta: dict, finish: str | None) -> str:
        return "data: " + json.dumps({**head, "choices": [{"index": index, "delta": delta, "logprobs": None,
                                                           "finish_reason": finish}]}) + "\n\n"

    for choice, pieces in zip(answer["choices"], deltas, strict=True):
        yield chunk(choice["index"], {"role": "assistant", "content": ""}, None)
        for piece in pieces:
            yield chunk(choice["index"], {"content": piece}, None)
        yield chunk(choice["index"], {}, choice["finish_reason"])
    yield "data: [DONE]\n\n"


class ServerThread(AppThread):
    """`create_app(service, access)` under uvicorn in a thread of this process (tests, `rft bench serve`): `url` once
    `start()` returns; `stop()` ends it (the service is the caller's to close)."""

    def __init__(self, service: ServeService, *, host: str = "127.0.0.1", port: int = 0,
                 access: Access | None = None):
        super().__init__(create_app(service, access), host=host, port=port)
