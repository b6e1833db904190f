"""Sleep mode, weight updates and the prefix cache over HTTP, as vLLM and SGLang serve them:

- ``POST /reset_prefix_cache`` (vLLM): forget every cached block; 409 while requests hold blocks.
- With ``--enable-sleep-mode``: ``POST /sleep?level=1|2``, ``POST /wake_up``, ``GET /is_sleeping``
  (vLLM's), and SGLang's weight syncs of an RL trainer: ``POST /update_weights_from_disk`` with
  ``{"model_path": ...}``, and over ``torch.distributed`` ``POST /init_weights_update_group``,
  ``/update_weights_from_distributed`` and ``/destroy_weights_update_group``
  (:mod:`engine.core.weight_sync` says what the trainer runs). Sleeping and updating wait for
  the requests in flight to finish; requests that come meanwhile, or while asleep, get 503 with
  ``Retry-After``.

Each call goes to every data-parallel engine core (a trainer's group is refused with several),
and there to every tensor-parallel rank: a trainer's group takes them all, ``rank_offset`` on."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine_server.errors import APIError, bad_request
from engine_server.responses import IsSleeping, UpdateWeightsResult
from engine_server.schemas import (
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsRequest,
)
from engine_server.validation import decode_body

BODILESS = frozenset(
    {"/reset_prefix_cache", "/sleep", "/wake_up", "/destroy_weights_update_group"}
)  # POSTs that take no body (vLLM's)


def routes(sleep_mode: bool) -> list[Route]:
    always = [Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])]
    if not sleep_mode:  # a 404, as vLLM without it
        return always
    return always + [
        Route("/sleep", sleep, methods=["POST"]),
        Route("/wake_up", wake_up, methods=["POST"]),
        Route("/is_sleeping", is_sleeping),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/init_weights_update_group", init_weights_update_group, methods=["POST"]),
        Route("/update_weights_from_distributed", update_weights_from_distributed, methods=["POST"]),
        Route("/destroy_weights_update_group", destroy_weights_update_group, methods=["POST"]),
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


def _succeeded(message: str) -> JSONResponse:
    return JSONResponse(msgspec.to_builtins(UpdateWeightsResult(True, message)))


async def init_weights_update_group(request: Request):
    state = request.app.state.server
    body = decode_body(await state.read(request), InitWeightsUpdateGroupRequest, state.allow_unknown_fields)
    if len(getattr(state.client, "replicas", ())) > 1:
        raise bad_request("init_weights_update_group: not with several data-parallel engine cores yet")
    await _control(request, "init_weights_update_group", **msgspec.to_builtins(body))
    return _succeeded(
        f"joined {body.group_name!r} from rank {body.rank_offset} (one rank per tensor-parallel rank) "
        f"of {body.world_size}"
    )


async def update_weights_from_distributed(request: Request):
    state = request.app.state.server
    body = decode_body(
        await state.read(request), UpdateWeightsFromDistributedRequest, state.allow_unknown_fields
    )
    names, dtypes, shapes = body.names, body.dtypes, body.shapes
    if body.name is not None:
        names, dtypes, shapes = [body.name], [body.dtype or "bfloat16"], [body.shape or []]
    if not names:
        raise bad_request("give the tensors' 'names', 'dtypes' and 'shapes'", "names")
    await _control(request, "update_weights_from_distributed", names=names, dtypes=dtypes, shapes=shapes)
    return _succeeded(f"{len(names)} tensors received")


async def destroy_weights_update_group(request: Request):
    await _control(request, "destroy_weights_update_group")
    return _succeeded("left the weight update group")
