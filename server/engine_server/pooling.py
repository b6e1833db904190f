"""What the pooling routes (``/v1/embeddings``, ``/score``, ``/rerank``, ``/classify``)
share: one HTTP request's engine requests submitted together, so the engine pools them in the
same steps, and their vectors (little-endian float32 bytes) collected, each request's metrics
recorded as it finishes."""

from __future__ import annotations

import time

import numpy as np
from starlette.requests import Request

from engine.client import EngineDead
from engine.messages.sampling_params import InvalidParam, truncation_length
from engine_server.errors import bad_request, engine_dead, engine_unavailable, overloaded
from engine_server.generation import unless_disconnected

Child = tuple  # (engine request id, prompt token ids, PoolingParams)


async def pool(
    state, request: Request, request_id: str, children: list[Child], priority: int, param: str
) -> dict:
    """Engine request id -> its pooled vector's bytes; ``param`` names the input field a
    request the engine refuses is blamed on (a 400)."""
    try:
        handle = state.client.submit(children, priority)
    except EngineDead:
        raise engine_unavailable() from None
    timers = {rid: state.metrics.start_request(len(ids), None, 1)[0] for rid, ids, _ in children}
    vectors: dict[str, bytes] = {}
    try:
        await unless_disconnected(request, _collect(handle, vectors, timers, param))
    except EngineDead as exc:
        raise engine_dead(exc, request_id) from None
    finally:
        handle.close()
    return vectors


async def _collect(handle, vectors: dict[str, bytes], timers: dict, param: str) -> None:
    async for delta in handle.deltas():
        if delta.finish_reason is not None:
            timers[delta.request_id].finished(delta.finish_reason)
        if delta.finish_reason == "error":
            if delta.error_code == "overloaded":
                raise overloaded(delta.error)
            raise bad_request(delta.error or "the engine rejected this input", param)
        if delta.embedding is not None:
            vectors[delta.request_id] = delta.embedding


def kept_tokens(state, truncate_prompt_tokens: int | None) -> int | None:
    """How many tokens of each input a request's ``truncate_prompt_tokens`` keeps (None: all;
    -1: the context); a 400 naming the field beyond the context or for 0."""
    try:
        return truncation_length(truncate_prompt_tokens, state.max_model_len)
    except InvalidParam as exc:
        raise bad_request(str(exc), exc.param) from None


def floats(raw: bytes) -> np.ndarray:
    """A pooled vector's bytes as float32 values."""
    return np.frombuffer(raw, dtype="<f4")


def prompt_tokens(children: list[Child]) -> int:
    return sum(len(ids) for _, ids, _ in children)


def list_body(request_id: str, model: str, data: list[dict], prompt_tokens: int) -> dict:
    """The ``{"object": "list", "data": [...]}`` response the embeddings, score and classify
    routes share, with its usage (pooling generates nothing: total = prompt tokens)."""
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
