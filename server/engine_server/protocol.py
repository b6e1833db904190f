"""Messages between the API process and the engine-core process: msgpack-encoded msgspec
structs over ZMQ (compact, typed, no pickle on a socket)."""

from __future__ import annotations

from typing import Any

import msgspec


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams.to_dict()
    priority: int = 0
    cache_salt: str | None = None


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    default_sampling_params: dict[str, Any] = msgspec.field(default_factory=dict)  # from --generation-config
    cache_info: dict[str, str] = msgspec.field(default_factory=dict)  # EngineCore.cache_info()


class Delta(msgspec.Struct, array_like=True):
    """What one request gained in one step. Logprob entries are (token ids, logprobs,
    ranks) with the chosen token first."""

    request_id: str
    token_ids: list[int]
    logprobs: list[tuple[list[int], list[float], list[int]]] | None = None
    prompt_logprobs: list[tuple[list[int], list[float], list[int]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None  # with finish_reason "error": "overloaded" (admission refused it), or None
    timing: tuple[float, float] | None = None  # (queue, prefill) seconds, with the first token: RequestTiming


class Outputs(msgspec.Struct, tag=True):
    deltas: list[Delta]
    stats: dict[str, float] | None = None


class Fatal(msgspec.Struct, tag=True):
    message: str


ToCore = AddRequest | Abort | Shutdown
FromCore = Ready | Outputs | Fatal

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(message) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)
