"""Bounds on what one request may make the server produce. A request of a few kilobytes can
ask for a response of hundreds of megabytes (many samples of a long prompt, each with many
log-probs per token): it is refused up front by the size of what it asks for
(:func:`check_budget`), and a response that still turns out larger than
``--max-response-bytes`` is refused instead of sent. Large bodies are built and serialised on
a worker thread, so writing one never stalls the other clients' streams or /health."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from engine_server.errors import APIError, bad_request

# log-prob entries (or tokens) above which a response is built on a worker thread: below it
# the hop to the thread costs more than the work
HEAVY_ENTRIES = 4096


def budget_units(n: int, prompt_lengths: list[int], max_tokens: int, top_n: int) -> int:
    """``n × (prompt + max_tokens) × (logprobs + 1)`` summed over the prompts: the tokens and
    log-prob alternatives the request may make the server compute and send."""
    return sum(n * (length + max_tokens) * (top_n + 1) for length in prompt_lengths)


def check_budget(state, n: int, prompt_lengths: list[int], max_tokens: int, top_n: int, param: str) -> None:
    """A 400 naming the product and the limit (``--max-request-budget``; 0: none)."""
    limit = state.max_request_budget
    units = budget_units(n, prompt_lengths, max_tokens, top_n)
    if not limit or units <= limit:
        return
    prompts = (
        f"{prompt_lengths[0]} prompt tokens"
        if len(prompt_lengths) == 1
        else f"{sum(prompt_lengths)} prompt tokens over {len(prompt_lengths)} prompts"
    )
    raise bad_request(
        "this request asks for n x (prompt + max_tokens) x (logprobs + 1) = "
        f"{n} x ({prompts} + {max_tokens}) x ({top_n} + 1) = {units} tokens and log-probs, "
        f"more than this server's limit of {limit} "
        "(--max-request-budget); ask for fewer samples, tokens or log-probs",
        param,
        code="request_too_large",
    )


def too_large(size: int, limit: int) -> APIError:
    """413 for a response over ``--max-response-bytes`` (the status of a body that is too
    large; here the one the request asked for)."""
    return APIError(
        413,
        f"the response would be {size} bytes, more than this server's limit of {limit} bytes "
        "(--max-response-bytes); ask for fewer samples, tokens or log-probs",
        code="response_too_large",
    )


def encode(payload: dict, limit: int) -> bytes:
    """The JSON of a response, or :func:`too_large`. msgspec, not ``json``: it is several
    times faster on the nested log-prob lists that make responses large."""
    data = msgspec.json.encode(payload)
    if limit and len(data) > limit:
        raise too_large(len(data), limit)
    return data


async def json_response(state, build, entries: int) -> Response:
    """``build()``'s dict as a JSON response: built and encoded on a worker thread when it
    holds more than :data:`HEAVY_ENTRIES` tokens and log-probs, else here."""
    limit = state.max_response_bytes
    if entries > HEAVY_ENTRIES:
        data = await state.offload(lambda: encode(build(), limit))
    else:
        data = encode(build(), limit)
    return Response(data, media_type="application/json")


def salted(tenant: str | None, given: str | None) -> str | None:
    """The request's cache salt under its API key's (``tenant``): a client's own salt splits
    its key's cache further but can never reach another key's blocks."""
    if tenant is None:
        return given
    return tenant if given is None else f"{tenant}:{given}"
