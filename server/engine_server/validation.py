"""Checks at the edge that the request types alone cannot express: the body size enforced
while the body streams in, a JSON nesting-depth limit applied before anything recursive
(jinja, xgrammar, jsonschema) sees the data, and JSON schemas checked against their
meta-schema so an invalid one is a 400 at once instead of waiting for the busy engine."""

from __future__ import annotations

import asyncio
import re

import jsonschema
import msgspec
from starlette.requests import ClientDisconnect, Request

from engine_server.errors import APIError, bad_request

MAX_JSON_DEPTH = 64


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def read_body(request: Request, max_bytes: int, timeout: float | None = None) -> bytes:
    """The whole body, cut off with a 413 as soon as it passes ``max_bytes`` (a chunked
    body is never buffered beyond the limit), and with a 408 that closes the connection when
    it has not all arrived ``timeout`` seconds after the headers: the HTTP server (uvicorn)
    waits for a body forever, so a client trickling bytes below its Content-Length
    (slowloris) would otherwise hold a connection and a task as long as it likes."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout or None):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise APIError(413, f"the request body exceeds the limit of {max_bytes} bytes")
                chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout:g} s (received {size} bytes)",
            code="body_timeout",
            headers={"Connection": "close"},
        ) from None
    return b"".join(chunks)


def decode_body(data: bytes, body_type, allow_unknown: bool = False):
    """The typed body; malformed JSON, too deep nesting, wrong or out-of-range values and
    (unless ``allow_unknown``) fields this server does not implement are 400s naming the field."""
    try:
        raw = msgspec.json.decode(data)
    except RecursionError:
        raise bad_request(f"the request nests JSON deeper than {MAX_JSON_DEPTH} levels") from None
    except msgspec.ValidationError as exc:  # a number no float can hold
        raise bad_request(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"malformed JSON body: {exc}") from None
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object")
    for field, value in raw.items():
        check_depth(value, field, MAX_JSON_DEPTH - 1)
    if not allow_unknown:
        check_known_fields(raw, body_type)
    try:
        return msgspec.convert(raw, type=body_type)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if "at `$." in message:
            param = message.rsplit("at `$.", 1)[-1].rstrip("`").split("[")[0].split(".")[0]
        else:  # a top-level required field left out names itself: "... missing required field `query`"
            missing = re.fullmatch(r"Object missing required field `(\w+)`", message)
            param = missing.group(1) if missing else None
        raise bad_request(f"invalid request: {message}", param) from None


def check_known_fields(raw: dict, body_type) -> None:
    """A field the server does not implement is refused rather than silently ignored (a
    client setting ``logit_bias`` must not get a 200 that ignored it); ``null`` counts as
    not set."""
    unknown = sorted(
        name for name, value in raw.items() if value is not None and name not in body_type.__struct_fields__
    )
    if unknown:
        raise bad_request(
            f"unsupported field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: this server "
            "does not implement it (start it with --allow-unknown-fields to ignore such fields)",
            unknown[0],
            code="unsupported_field",
        )


def check_depth(value, param: str, limit: int = MAX_JSON_DEPTH) -> None:
    """A 400 when ``value`` nests lists/objects more than ``limit`` levels (walked without
    recursion, so any depth is safe to check)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            raise bad_request(f"{param} nests JSON deeper than {MAX_JSON_DEPTH} levels", param)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def parse_json_text(text: str, param: str):
    """A JSON value given as a string (vLLM accepts schemas that way), depth-checked."""
    try:
        value = msgspec.json.decode(text)
    except (RecursionError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
    check_depth(value, param)
    return value


def check_json_schema(schema, param: str, where: str | None = None) -> dict:
    """``schema`` must be an object that validates against its meta-schema (by its
    ``$schema``, else the newest draft); formats are not checked, since the grammar
    compiler's regex dialect is not Python's."""
    where = where or param
    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON schema object", param)
    check_depth(schema, param)
    if not isinstance(schema.get("$schema", ""), str):
        raise bad_request(f"{where}.$schema must be a string", param)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(validator(validator.META_SCHEMA).iter_errors(schema))
    if error is not None:
        path = "".join(f"[{p!r}]" for p in error.absolute_path)
        raise bad_request(f"invalid json schema in {where}{path}: {error.message}", param)
    return schema
