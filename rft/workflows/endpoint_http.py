"""The HTTP face of the recording endpoint (rft/workflows/endpoint.py, whose docstring lists the routes): FastAPI
routes over a `RecordingEndpoint`. Every route first passes rft.observability.access's checks with no keys and loopback
Host names (the episode's key is checked by the route: it names the episode)."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rft.observability.access import Access, AccessDenied, BearerCredentials, allowed_hosts
from rft.text.openai_api import ApiError, json_body
from rft.workflows.agent_requests import EndpointCalls, parse_agent_request


def create_app(endpoint: EndpointCalls) -> FastAPI:
    """The endpoint's routes (module docstring) over `endpoint`."""
    access = Access(frozenset(), allowed_hosts([], "127.0.0.1"))  # loopback Host names, JSON bodies
    app = FastAPI(title="rft recording endpoint", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[access.dependency()])

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(AccessDenied)
    async def denied(request: Request, e: AccessDenied) -> JSONResponse:
        return error(ApiError(e.status, str(e), code=e.code, headers=e.headers))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, credentials: BearerCredentials) -> JSONResponse:
        try:
            # an episode's key: its bearer, or X-RFT-Episode from a client that sends its own bearer (verifiers')
            episode = endpoint.episode(request.headers.get("x-rft-episode")
                                       or (credentials.credentials if credentials else None))
            body = await json_body(request, endpoint.settings.max_body_bytes, "the endpoint's max_body_bytes")
            call = parse_agent_request(body, endpoint.settings)
            future = endpoint.submit(episode, call)
            timeout = endpoint.settings.request_timeout_s
            try:
                answer = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
            except asyncio.TimeoutError:
                raise ApiError(504, f"the call was not generated within {timeout:g} s", code="timeout",
                               kind="server_error") from None
        except ApiError as e:
            return error(e)
        return JSONResponse(answer)

    @app.get("/v1/models")
    def models(credentials: BearerCredentials) -> JSONResponse:
        try:
            endpoint.episode(credentials.credentials if credentials else None)
        except ApiError as e:
            return error(e)
        return JSONResponse({"object": "list", "data": [{"id": endpoint.settings.model_name, "object": "model",
                                                         "created": endpoint.started, "owned_by": "rft"}]})

    return app
