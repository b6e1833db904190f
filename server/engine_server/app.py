"""The starlette app: routes, the API-key and body-size guard, OpenAI-shaped errors."""

from __future__ import annotations

import importlib.metadata
import logging

import attrs
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine_server import generation
from engine_server.errors import APIError, bad_request
from engine_server.schemas import BODIES, DetokenizeRequest, TokenizeRequest

logger = logging.getLogger("engine_server")


@attrs.define
class ServerState:
    client: object  # EngineClient
    tokenizer: object
    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    metrics: object  # Metrics
    tool_parser: type | None = None  # ToolParser class for tool_choice="auto"
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    default_sampling_params: dict = attrs.Factory(dict)  # the model's generation config (--generation-config)


class Guard:
    """Pure ASGI middleware (so streaming and disconnects pass untouched): the API key on
    /v1 routes and the declared body size."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            error = None
            if self.state.api_key and scope["path"].startswith("/v1"):
                if headers.get(b"authorization", b"").decode() != f"Bearer {self.state.api_key}":
                    error = APIError(401, "invalid or missing API key", code="invalid_api_key")
            length = headers.get(b"content-length")
            if error is None and length is not None and int(length) > self.state.max_body_bytes:
                error = APIError(413, f"request body of {int(length)} bytes exceeds the limit of "
                                      f"{self.state.max_body_bytes}")
            if error is not None:
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


async def models(request: Request):
    state = request.app.state.server
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": 0, "owned_by": "engine", "root": state.model_path,
        "max_model_len": state.max_model_len, "default_sampling_params": state.default_sampling_params}]})


async def tokenize(request: Request):
    state = request.app.state.server
    body = await generation.read_body(request, TokenizeRequest, state.max_body_bytes)
    generation.check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if body.prompt is not None:
        ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        ids = generation.chat_prompt(state.tokenizer, body.messages, True)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len})


async def detokenize(request: Request):
    state = request.app.state.server
    body = await generation.read_body(request, DetokenizeRequest, state.max_body_bytes)
    generation.check_model(state, body.model)
    if any(not 0 <= t < state.vocab_size for t in body.tokens):
        raise bad_request(f"token ids must be in [0, {state.vocab_size})", "tokens")
    return JSONResponse({"prompt": state.tokenizer.decode(body.tokens)})


async def health(request: Request):
    dead = request.app.state.server.client.dead
    if dead:
        return APIError(503, f"engine core is not running: {dead}", code="engine_dead").response()
    return Response(status_code=200)


async def version(request: Request):
    return JSONResponse({"version": importlib.metadata.version("tessellm-server")})


async def metrics(request: Request):
    return Response(request.app.state.server.metrics.render(), media_type="text/plain; version=0.0.4")


_PATHS = {
    "/v1/completions": ("post", "CompletionRequest", "Create a completion (stream with `stream: true`)"),
    "/v1/chat/completions": ("post", "ChatCompletionRequest", "Create a chat completion"),
    "/tokenize": ("post", "TokenizeRequest", "Token ids of a prompt or chat"),
    "/detokenize": ("post", "DetokenizeRequest", "Text of token ids"),
    "/v1/models": ("get", None, "The served model"),
    "/health": ("get", None, "200 while the engine core runs, 503 otherwise"),
    "/version": ("get", None, "Server version"),
    "/metrics": ("get", None, "Prometheus metrics"),
}


async def openapi(request: Request):
    _, components = msgspec.json.schema_components(list(BODIES.values()), ref_template="#/components/schemas/{name}")
    paths = {}
    for path, (method, body, summary) in _PATHS.items():
        operation = {"summary": summary, "responses": {"200": {"description": "OK"},
                                                       "4XX": {"description": "OpenAI-shaped error"}}}
        if body:
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{body}"}}}}
        paths[path] = {method: operation}
    return JSONResponse({"openapi": "3.1.0", "info": {"title": "engine", "version": "0.1.0"},
                         "paths": paths, "components": {"schemas": components}})


async def _api_error(request, exc: APIError):
    return exc.response()


async def _http_error(request, exc: HTTPException):
    return APIError(exc.status_code, exc.detail or "error", code=str(exc.status_code)).response()


async def _unexpected(request, exc: Exception):
    logger.exception("unhandled error on %s", request.url.path)
    return APIError(500, f"internal error: {exc!r}").response()


def build_app(state: ServerState, lifespan=None) -> Starlette:
    routes = [
        Route("/v1/completions", generation.completions, methods=["POST"]),
        Route("/v1/chat/completions", generation.chat_completions, methods=["POST"]),
        Route("/v1/models", models), Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]), Route("/health", health),
        Route("/version", version), Route("/metrics", metrics), Route("/openapi.json", openapi),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected})
    app.state.server = state
    app.add_middleware(Guard, state=state)
    return app
