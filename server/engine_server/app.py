"""The starlette app: routes, the guard in front of them (:mod:`engine_server.guard`),
errors in each route's shape (OpenAI's; Anthropic's on ``/v1/messages``), and the worker
threads that do the heavy per-request work."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

import attrs
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, get_route_path

from engine_server import anthropic, classify, console, embeddings, generation, responses_api, scoring, sleep
from engine_server.bounds import encode
from engine_server.errors import APIError, anthropic_route, bad_request, internal_error
from engine_server.guard import OPEN_PATHS, Guard
from engine_server.harmony import render_chat
from engine_server.images import ImageInput
from engine_server.lora import LoRAAdapters, load_lora_adapter, unload_lora_adapter
from engine_server.openapi import spec as openapi_spec
from engine_server.prompts import chat_prompt
from engine_server.responses_store import ResponseStore
from engine_server.schemas import DetokenizeRequest, TokenizeRequest
from engine_server.validation import ClientGone, decode_body, read_body

logger = logging.getLogger("engine_server")

PREPARE_THREADS = 2  # tokenizing and templating run here, off the event loop


@attrs.define
class ServerState:
    client: object  # ReplicaSet
    tokenizer: object
    model_name: str
    max_model_len: int
    vocab_size: int
    metrics: object  # Metrics
    tool_parser: type | None = None  # ToolParser class for tool_choice="auto"
    reasoning_parser: type | None = None  # ReasoningParser class (--reasoning-parser)
    harmony: bool = False  # a gpt-oss model: chat prompts rendered in harmony (engine_server.harmony)
    api_keys: tuple[str, ...] = ()  # any of them is accepted; none: no key needed
    api_key_cache_salt: bool = True  # each key's requests get their own prefix-cache salt
    allowed_hosts: list[str] | None = None  # Host header names accepted; None: any
    max_body_bytes: int = 4 * 2**20
    body_timeout: float = 60.0  # seconds a request body may take to arrive (slowloris)
    max_response_bytes: int = 64 * 2**20  # a larger response is refused (413); 0: no limit
    max_request_budget: int = 4 * 2**20  # n x (prompt + max_tokens) x (logprobs + 1); 0: no limit
    max_request_sequences: int = 256  # engine requests one HTTP request may create (prompts × n)
    default_sampling_params: dict = attrs.Factory(dict)  # the model's generation config (--generation-config)
    # the guarantee temperature-0 output has (EngineCore.determinism): "batch-invariant",
    # "chunk-invariant" or "none"
    determinism: str = "none"
    runner: str = "generate"  # the engine's runner: "pooling" serves /v1/embeddings instead of completions
    embedding_size: int = 0  # with the pooling runner: the vectors' length, and whether
    matryoshka: bool = False  # ... `dimensions` may cut them (to one of these, when listed)
    matryoshka_dimensions: list[int] | None = None
    classifier_labels: list[str] = attrs.Factory(list)  # a classifier's (/classify, cross-encoder /score)
    allow_unknown_fields: bool = False  # --allow-unknown-fields: ignore them instead of a 400
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: the request field's default
    enable_prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage.prompt_tokens_details
    log_requests: bool = False  # --enable-log-requests
    max_log_len: int | None = None  # characters / token ids of a prompt logged with it
    heartbeat_timeout: float = 30.0  # --engine-heartbeat-timeout: /health's limit on a busy core's silence
    keepalive_interval: float | None = 15.0  # --stream-keepalive-interval: blank SSE lines while no token
    web_ui: bool = True  # the console at /ui/ (--disable-web-ui: off)
    tracing: object | None = None  # Tracing, with --otlp-traces-endpoint
    request_timings: bool = False  # --enable-request-timings: "timings" in every response
    lora: LoRAAdapters | None = None  # with --enable-lora: the adapters served by name
    sleep_mode: bool = False  # --enable-sleep-mode: /sleep, /wake_up, /is_sleeping, /update_weights_from_disk
    images: ImageInput = attrs.Factory(ImageInput)  # a multimodal model's processor, --allowed-media-*
    responses: ResponseStore = attrs.Factory(ResponseStore)  # /v1/responses stored (--responses-store-*)
    executor: ThreadPoolExecutor = attrs.field(
        factory=lambda: ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="engine-prepare")
    )

    async def offload(self, fn, *args):
        """``fn(*args)`` on a worker thread, so a 4 MB prompt or a long template does not
        stall every other client's stream."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def read(self, request) -> bytes:
        """The request's body, within the size and time limits (:func:`read_body`)."""
        return await read_body(request, self.max_body_bytes, self.body_timeout)


async def models(request: Request):
    state = request.app.state.server
    base = {
        "id": state.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "engine",
        "root": state.model_name,
        "parent": None,
        "max_model_len": state.max_model_len,
        "default_sampling_params": state.default_sampling_params,
        "determinism": state.determinism,
    }
    adapters = state.lora.cards(base) if state.lora is not None else []
    return JSONResponse({"object": "list", "data": [base, *adapters]})


def _tokenize(state: ServerState, data: bytes) -> dict:
    body = decode_body(data, TokenizeRequest, state.allow_unknown_fields)
    generation.check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if body.prompt is not None:
        ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    elif state.harmony:  # as /v1/chat/completions renders a gpt-oss conversation
        messages = [msgspec.structs.asdict(m) for m in body.messages or []]
        ids = render_chat(messages, None, body.chat_template_kwargs)
    else:
        ids, _ = chat_prompt(
            state.tokenizer,
            body.messages,
            body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            template_kwargs=body.chat_template_kwargs,
            images=state.images,
        )
    return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}


def _detokenize(state: ServerState, data: bytes) -> dict:
    body = decode_body(data, DetokenizeRequest, state.allow_unknown_fields)
    generation.check_model(state, body.model)
    if any(t >= state.vocab_size for t in body.tokens):
        raise bad_request(f"token ids must be in [0, {state.vocab_size})", "tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}


async def _on_worker(request: Request, answer) -> Response:
    """``answer(state, body)`` and its JSON both on a worker thread: the token list of a 4 MB
    prompt is megabytes of JSON too."""
    state = request.app.state.server
    data = await state.read(request)
    body = await state.offload(lambda: encode(answer(state, data), state.max_response_bytes))
    return Response(body, media_type="application/json")


async def tokenize(request: Request):
    return await _on_worker(request, _tokenize)


async def detokenize(request: Request):
    return await _on_worker(request, _detokenize)


async def health(request: Request):
    """200 while the engine core runs and, when it has requests in flight, shows progress
    within ``--engine-heartbeat-timeout``; a 503 naming the reason otherwise."""
    state = request.app.state.server
    if state.client.dead:
        return APIError(503, "the engine core is not running", code="engine_dead").response()
    problem = state.client.unresponsive(state.heartbeat_timeout)
    if problem:
        return APIError(503, problem, code="engine_unresponsive").response()
    return Response(status_code=200)


async def version(request: Request):
    return JSONResponse({"version": importlib.metadata.version("tessellm-server")})


async def metrics(request: Request):
    return Response(request.app.state.server.metrics.render(), media_type="text/plain; version=0.0.4")


async def openapi(request: Request):
    return JSONResponse(openapi_spec(request.app.state.server))


def _shaped(request, error: APIError) -> Response:
    """The error in the shape the route's clients expect (OpenAI's, or Anthropic's)."""
    return error.response(anthropic=anthropic_route(get_route_path(request.scope)))


async def _api_error(request, exc: APIError):
    return _shaped(request, exc)


async def _client_gone(request, exc: ClientGone):
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def _http_error(request, exc: HTTPException):
    """Starlette's own refusals (404, 405 with its ``Allow`` header) in the route's shape."""
    return _shaped(
        request,
        APIError(exc.status_code, exc.detail or "error", code=str(exc.status_code), headers=exc.headers),
    )


async def _unexpected(request, exc: Exception):
    request_id = f"err-{uuid.uuid4().hex}"
    logger.error("request %s: unhandled error on %s", request_id, request.url.path, exc_info=exc)
    return _shaped(request, internal_error(request_id))


def build_app(state: ServerState, lifespan=None, outer_middleware=()) -> Starlette:
    """``outer_middleware``: (class, options) pairs wrapped around the API-key guard (CORS,
    so that a browser's preflight, which carries no key, is answered)."""
    routes = [
        Route("/v1/completions", generation.completions, methods=["POST"]),
        Route("/v1/chat/completions", generation.chat_completions, methods=["POST"]),
        Route("/v1/messages", anthropic.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
        Route("/v1/embeddings", embeddings.embeddings, methods=["POST"]),
        *(Route(path, scoring.score, methods=["POST"]) for path in ("/score", "/v1/score")),
        *(Route(path, scoring.rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
        *(Route(path, classify.classify, methods=["POST"]) for path in ("/classify", "/v1/classify")),
        Route("/v1/models", models),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health),
        Route("/version", version),
        Route("/metrics", metrics),
        Route("/openapi.json", openapi),
        *responses_api.routes(),
        *sleep.routes(state.sleep_mode),
        *(console.routes() if state.web_ui else ()),
    ]
    if state.lora is not None and state.lora.runtime:  # else a 404, as vLLM without runtime updating
        routes += [
            Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            APIError: _api_error,
            ClientGone: _client_gone,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )
    app.state.server = state
    body_paths = frozenset(route.path for route in routes if "POST" in route.methods) - sleep.BODILESS
    open_paths = OPEN_PATHS + (console.PATHS if state.web_ui else ())
    app.add_middleware(Guard, state=state, body_paths=body_paths, open_paths=frozenset(open_paths))
    for cls, options in outer_middleware:
        app.add_middleware(cls, **options)
    return app
