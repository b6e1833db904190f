"""KV events over ZMQ in vLLM's wire format (``--kv-events-config``), so a router written for
vLLM (llm-d's, Dynamo's, vLLM's own example subscriber) tracks this engine's prefix cache.

Each engine step with events is one message on a PUB socket: three frames, the topic, an
8-byte big-endian sequence number and a msgpack ``KVEventBatch`` ``[ts, [event, ...],
data_parallel_rank]``, each event an array tagged by its name — ``["BlockStored", hashes,
parent_hash, token_ids, block_size, lora_id, medium]``, ``["BlockRemoved", hashes, medium]``,
``["AllBlocksCleared"]`` — hashes as 64-bit integers (the low 64 bits of the engine's
sha256 chain, as vLLM sends them). With ``replay_endpoint`` a ROUTER socket answers
``[start_seq]`` with every buffered batch from that number on, then ``[-1, b""]``.

Publishing never blocks the step: a subscriber that falls ``hwm`` batches behind loses
batches (and can replay them)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from engine.messages import kv_events
from engine.messages.kv_events import KVEventsConfig, external_hash

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def wire_event(event, medium: str):
    if isinstance(event, kv_events.BlockStored):
        parent = None if event.parent_block_hash is None else external_hash(event.parent_block_hash)
        return BlockStored(
            [external_hash(h) for h in event.block_hashes],
            parent,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            medium=medium,
        )
    if isinstance(event, kv_events.BlockRemoved):
        return BlockRemoved([external_hash(h) for h in event.block_hashes], medium=medium)
    return AllBlocksCleared()


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """Data-parallel replica ``rank``'s endpoint: a TCP port + rank, an IPC path + ``_dp<rank>``."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, port = endpoint.rsplit(":", 1)
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def subscriber_endpoint(endpoint: str, rank: int) -> str | None:
    """Where a subscriber on this machine reaches replica ``rank``'s publisher (None: the
    publisher connects out to a named host, so only that host's broker can be reached)."""
    endpoint = endpoint_for_rank(endpoint, rank)
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint
    if "*" in endpoint:
        return endpoint.replace("*", "127.0.0.1", 1)
    return None


async def follow(
    context: zmq.asyncio.Context, config: KVEventsConfig, rank: int, on_batch: Callable[[KVEventBatch], None]
) -> None:
    """Feed replica ``rank``'s event batches to ``on_batch`` until cancelled."""
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, config.topic.encode())
    socket.connect(subscriber_endpoint(config.endpoint, rank))
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        while True:
            _, _, payload = await socket.recv_multipart()
            on_batch(decoder.decode(payload))
    finally:
        socket.close(linger=0)


def _attach(socket: zmq.Socket, endpoint: str) -> None:
    """Bind a wildcard, IPC or in-process endpoint (this side serves); connect to a named host."""
    if endpoint.startswith(("ipc://", "inproc://")) or "*" in endpoint or "::" in endpoint:
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, medium: str, data_parallel_rank: int = 0):
        self.config, self.medium, self.rank = config, medium, data_parallel_rank
        self.topic = config.topic.encode()
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, config.hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        _attach(self.pub, endpoint_for_rank(config.endpoint, data_parallel_rank))
        self.replay = None
        if config.replay_endpoint:
            self.replay = self.context.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(endpoint_for_rank(config.replay_endpoint, data_parallel_rank))
        self.sequence = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)

    def publish(self, events: list) -> None:
        if not events:
            return
        batch = KVEventBatch(time.time(), [wire_event(e, self.medium) for e in events], self.rank)
        payload = msgspec.msgpack.encode(batch)
        # a PUB socket never blocks: past a subscriber's high-water mark it drops for that one
        self.pub.send_multipart((self.topic, self.sequence.to_bytes(8, "big"), payload))
        self.buffer.append((self.sequence, payload))
        self.sequence += 1

    def serve_replay(self) -> None:
        """Answer the replay requests waiting now (never waits for one)."""
        while self.replay is not None and self.replay.poll(0):
            client, _, start = self.replay.recv_multipart()
            first = int.from_bytes(start, "big")
            for sequence, payload in self.buffer:
                if sequence >= first:
                    self.replay.send_multipart((client, b"", sequence.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def close(self) -> None:
        self.context.destroy(linger=0)
