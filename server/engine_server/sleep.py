"""Sleep mode, weight updates and the prefix cache over HTTP, as vLLM and SGLang serve them:

- ``POST /reset_prefix_cache`` (vLLM): forget every cached block; 409 while requests hold blocks.
- With ``--enable-sleep-mode``: ``POST /sleep?level=1|2``, ``POST /wake_up``, ``GET /is_sleeping``
  (vLLM's), and ``POST /update_weights_from_disk`` with ``{"model_path": ...}`` (SGLang's; an RL
  trainer's weight sync). Sleeping and updating wait for the requests in flight to finish;
  requests that come meanwhile, or while asleep, get 503 with ``Retry-After``.

Each call goes to every data-parallel engine core."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine_server.errors import APIError, bad_request
from engine_server.responses import IsSleeping, UpdateWeightsResult
from engine_server.schemas import UpdateWeightsRequest
from engine_server.validation import decode_body

BODILESS = frozenset({"/reset_prefix_cache", "/sleep", "/wake_up"})  # POSTs that take no body (vLLM's)


def routes(sleep_mode: bool) -> list[Route]:
    always = [Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])]
    if not sleep_mode:  # a 404, as vLLM without it
        return always
    return always + [
        Route("/sleep", sleep, methods=["POST"]),
        Route("/wake_up", wake_up, methods=["POST"]),
        Route("/is_sleeping", is_sleeping),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
    ]


async def _control(request: Request, method: str, **arguments) -> list:
    try:
        return await request.app.state.server.client.control(method, **arguments)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


async def reset_prefix_cache(request: Request):
    if not all(await _control(request, "reset_prefix_cache")):
        raise APIError(409, "requests hold cached blocks now; try again once they finish", code="busy")
    return Response(status_code=200)


async def sleep(request: Request):
    level = request.query_params.get("level", "1")
    if level not in ("1", "2"):
        raise bad_request(f"level must be 1 or 2, not {level!r}", "level")
    await _control(request, "sleep", level=int(level))
    return Response(status_code=200)


async def wake_up(request: Request):
    await _control(request, "wake_up")
    return Response(status_code=200)


async def is_sleeping(request: Request):
    return JSONResponse(msgspec.to_builtins(IsSleeping(any(await _control(request, "is_sleeping")))))


async def update_weights_from_disk(request: Request):
    state = request.app.state.server
    body = decode_body(await state.read(request), UpdateWeightsRequest, state.allow_unknown_fields)
    if not body.model_path:
        raise bad_request("'model_path' must be provided", "model_path")
    await _control(request, "update_weights_from_disk", model_path=body.model_path)
    result = UpdateWeightsResult(True, f"weights loaded from {body.model_path}")
    return JSONResponse(msgspec.to_builtins(result))
