"""Messages between a front end and the engine core: msgpack-encoded msgspec structs over ZMQ
to the engine-core process (compact, typed, no pickle on a socket). The in-process client
hands the same :class:`Delta` to its front end, so every front end reads one shape."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.messages.stats import EngineStats


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams.to_dict(), or PoolingParams.to_dict() when ``pooling``
    priority: int = 0
    cache_salt: str | None = None
    pooling: bool = False  # an embedding request (the engine runs the pooling runner)
    kv_transfer_params: dict[str, Any] | None = None  # P/D disaggregation, for the KV connector
    lora_request: dict[str, Any] | None = None  # LoRARequest.to_dict(): the adapter it runs with
    mm_items: list[dict[str, Any]] = msgspec.field(default_factory=list)  # MultiModalItem.to_dict() each


class AddBatch(msgspec.Struct, tag=True):
    """The engine requests of one HTTP request (its prompts and samples) in one message, so
    the core queues them all before its next step and they start in the same step."""

    requests: list[AddRequest]


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    pass


# EngineCore methods a front end may call between steps (sleep mode, weight updates, the prefix
# cache); the ones that change what requests compute wait until no request is in flight
CONTROL_METHODS = (
    "reset_prefix_cache",
    "sleep",
    "wake_up",
    "is_sleeping",
    "update_weights_from_disk",
    "init_weights_update_group",
    "update_weights_from_distributed",
    "destroy_weights_update_group",
)
WAITS_FOR_IDLE = ("sleep", "update_weights_from_disk", "update_weights_from_distributed")


class Control(msgspec.Struct, tag=True):
    """Call EngineCore.``method(**arguments)``; answered by a :class:`ControlResult` with ``call_id``."""

    call_id: int
    method: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)


class Ready(msgspec.Struct, tag=True):
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    default_sampling_params: dict[str, Any] = msgspec.field(default_factory=dict)  # from --generation-config
    cache_info: dict[str, str] = msgspec.field(default_factory=dict)  # EngineCore.cache_info()
    runner: str = "generate"  # "pooling": the engine embeds (/v1/embeddings) and generates nothing
    embedding_size: int = 0  # the pooled vector's length (the model's hidden size)
    matryoshka: bool = False  # whether embeddings may be cut to ``dimensions``
    matryoshka_dimensions: list[int] | None = None  # ... to one of these (None: any up to embedding_size)
    determinism: str = "none"  # EngineCore.determinism(): the guarantee temperature-0 output has
    startup: str = ""  # the start-up summary (engine.core.startup), for the front end to print
    classifier_labels: list[str] = msgspec.field(default_factory=list)  # a classifier's; empty: none


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
    embedding: bytes | None = None  # a pooling request's vector: little-endian float32, as OpenAI's base64
    kv_transfer_params: dict[str, Any] | None = None  # with the finish: what the KV connector hands on (P/D)
    num_draft_tokens: int = 0  # speculative drafts verified for this request so far, and accepted
    num_accepted_tokens: int = 0


class Outputs(msgspec.Struct, tag=True):
    deltas: list[Delta]
    stats: EngineStats | None = None


class ControlResult(msgspec.Struct, tag=True):
    call_id: int
    result: Any = None
    error: str | None = None  # the call raised: its message


class Fatal(msgspec.Struct, tag=True):
    message: str


HEARTBEAT_INTERVAL = 0.5  # seconds between a running core's Heartbeat messages, busy or idle


class Heartbeat(msgspec.Struct, tag=True):
    """Sent every :data:`HEARTBEAT_INTERVAL` by a thread of the core process apart from its step
    loop, so a long step does not silence it; what it reports is whether that loop still goes
    round. Its absence means the whole process is stopped (or a native call holds the GIL)."""

    round_age: float  # seconds since the step loop began its current round (a healthy one: 0.2 s or a step)
    steps: int  # steps run so far
    stepping: bool  # whether that round is inside a step now (False: receiving, sending, waiting)


ToCore = AddRequest | AddBatch | Abort | Shutdown | Control
FromCore = Ready | Outputs | Fatal | Heartbeat | ControlResult

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(message) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)
