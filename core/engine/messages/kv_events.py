"""KV cache events: what the prefix cache gained and lost, for a router outside the engine that
tracks which instance holds which prefix (vLLM's ``--kv-events-config``; the server publishes
them over ZMQ in vLLM's wire format).

A KV cache manager that publishes records them as it hashes and evicts blocks and hands them
over in step order from ``KVCacheManager.take_events()``. Hashes are the manager's own chained
block hashes (bytes); the publisher turns them into vLLM's 64-bit integers."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

import attrs

from engine.messages.multimodal import block_extra_keys

PUBLISHERS = ("null", "zmq")


def chain_hashes(
    tokens: Sequence[int],
    block_size: int,
    salt: str | None = None,
    parent: bytes | None = None,
    lora_id: int | None = None,
    block_extras: Sequence[bytes] = (),
) -> list[bytes]:
    """The prefix cache's hashes of the full blocks of ``tokens``: block i's is sha256(block
    i-1's hash — ``parent`` before the first, else the chain's seed — + its token ids as int64).
    The seed is the cache salt, followed by the LoRA adapter's id when there is one (the same
    tokens under another adapter have other keys and values). Equal hashes mean equal whole
    prefixes, salts and adapters, so a router can compute what an engine will report.
    ``block_extras``: per block, bytes hashed between the parent and the tokens (the ``mm_hash``
    of the images it overlaps); a block without them hashes as a text-only one."""
    hashes, previous = [], chain_seed(salt, lora_id) if parent is None else parent
    for index, start in enumerate(range(0, len(tokens) - block_size + 1, block_size)):
        extra = block_extras[index] if index < len(block_extras) else b""
        previous = hashlib.sha256(
            previous + extra + array("q", tokens[start : start + block_size]).tobytes()
        ).digest()
        hashes.append(previous)
    return hashes


def chain_seed(salt: str | None, lora_id: int | None) -> bytes:
    """What the first block's hash starts from: the salt, then ``\\0lora:<id>`` for an adapter
    (so base-model hashes stay as they were, and routers that know no adapters agree with them)."""
    seed = (salt or "").encode()
    return seed if lora_id is None else seed + b"\0lora:%d" % lora_id


def block_hashes(request, block_size: int) -> list[bytes]:
    """Extend ``request.block_hashes`` to every full block of its known tokens
    (:func:`chain_hashes`, under the request's cache salt and adapter, each block keyed by the
    images it overlaps)."""
    hashes = request.block_hashes
    start, end = len(hashes) * block_size, request.num_tokens // block_size * block_size
    items = getattr(request, "mm_items", ())
    extras = (
        [block_extra_keys(items, s, s + block_size) for s in range(start, end, block_size)] if items else ()
    )
    if end > start:
        hashes.extend(
            chain_hashes(
                request.all_token_ids[start:end],
                block_size,
                request.cache_salt,
                hashes[-1] if hashes else None,
                request.lora_id,
                extras,
            )
        )
    return hashes


def external_hash(block_hash: bytes) -> int:
    """A block hash as vLLM's KV events carry it: its low 64 bits, as an unsigned integer."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


@attrs.frozen
class BlockStored:
    """Consecutive full blocks entered the prefix cache: ``block_hashes`` in prefix order,
    ``parent_block_hash`` the hash of the block before the first (None: the prompt's start),
    ``token_ids`` all their tokens, ``lora_id`` the adapter they were computed under (None:
    the base model)."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None


@attrs.frozen
class BlockRemoved:
    """Blocks left the prefix cache (evicted for reuse)."""

    block_hashes: tuple[bytes, ...]


@attrs.frozen
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _check_publisher(instance, attribute, value):
    if value not in PUBLISHERS:
        raise ValueError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, got {value!r}")


@attrs.frozen
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` fields. ``publisher`` defaults to ``zmq`` when events are
    enabled; ``endpoint`` is bound (``tcp://*:5557``) or connected to; ``replay_endpoint`` (a
    ROUTER socket) answers a subscriber that missed batches with the last ``buffer_steps``
    from the sequence number it asks for; ``hwm`` is the PUB socket's high-water mark; with
    data parallelism replica i publishes on the endpoints' port + i."""

    enable_kv_cache_events: bool = False
    publisher: str | None = attrs.field(default=None, validator=attrs.validators.optional(_check_publisher))
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = attrs.field(default=10_000, validator=attrs.validators.ge(1))
    hwm: int = attrs.field(default=100_000, validator=attrs.validators.ge(0))
    max_queue_size: int = attrs.field(default=100_000, validator=attrs.validators.ge(1))
    topic: str = ""

    @property
    def publishing(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @classmethod
    def from_dict(cls, value: dict[str, Any] | KVEventsConfig | None) -> KVEventsConfig | None:
        """The config from its JSON object; an unknown field raises ValueError naming it."""
        if value is None or isinstance(value, cls):
            return value
        unknown = sorted(set(value) - set(attrs.fields_dict(cls)))
        if unknown:
            raise ValueError(
                f"kv_events_config: unknown field(s) {', '.join(unknown)} "
                f"(known: {', '.join(attrs.fields_dict(cls))})"
            )
        return cls(**value)
