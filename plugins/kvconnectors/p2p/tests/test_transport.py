"""The ZMQ transport on its own, two instances' transports in one process over real TCP: exact
bytes in bf16 into other block ids, a read that waits for its blocks to be exposed, and every
refusal (another layout, another engine id, blocks already freed, garbage on the socket) failing
the read with the reason in the log, never the transport."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
import torch
import zmq

from engine.kv_transfer import BlockLayout, Peer, Read, TransportContext
from engine.kv_transfer.connector import PDConnector
from engine.testing.ports import free_port
from engine_kvconnectors_p2p.transport import ZmqTransport

BLOCK_DIM = 1


def caches(width: int = 3, dtype=torch.float32, fill: bool = False) -> list[torch.Tensor]:
    made = [torch.zeros(2, 8, 4, width, dtype=dtype) for _ in range(2)]
    if fill:
        for cache in made:
            cache.copy_(torch.randn(cache.shape).to(dtype))
    return made


def transport(kv, engine_id: str, port: int = 0, timeout: float = 5.0) -> ZmqTransport:
    layout = BlockLayout.of(kv, BLOCK_DIM, 4)
    made = ZmqTransport(TransportContext(engine_id, "127.0.0.1", port, bool(port), layout, timeout))
    made.start(kv, BLOCK_DIM)
    return made


@pytest.fixture
def pair():
    """A prefill transport serving random bf16 caches and a decode transport with empty ones."""
    port = free_port()
    source, sink = caches(dtype=torch.bfloat16, fill=True), caches(dtype=torch.bfloat16)
    made = SimpleNamespace(
        source=source,
        producer=transport(source, "prefill-1", port),
        peer=Peer("prefill-1", "127.0.0.1", port),
        sink=sink,
        consumer=transport(sink, "decode-1"),
    )
    yield made
    made.producer.close()
    made.consumer.close()


def wait_done(transport_: ZmqTransport, request_id: str, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done = transport_.poll().reads_done
        if request_id in done:
            return done[request_id]
        time.sleep(0.005)
    raise AssertionError(f"read {request_id} never ended")


def test_exact_bf16_blocks_into_other_block_ids(pair):
    pair.producer.expose("p", [1, 5, 6])
    pair.consumer.read(Read("d", pair.peer, "p", (1, 5, 6), (7, 2, 3)))
    assert wait_done(pair.consumer, "d")
    for src, dst in zip(pair.source, pair.sink):
        assert torch.equal(src[:, [1, 5, 6]].view(torch.int16), dst[:, [7, 2, 3]].view(torch.int16))
    assert not pair.sink[0][:, [0, 1, 4, 5, 6]].any(), "nothing else was written"


def test_a_read_waits_for_its_blocks_to_be_exposed_and_the_release_arrives(pair):
    pair.consumer.read(Read("d", pair.peer, "p", (2,), (4,)))
    time.sleep(0.1)  # the prefill side exposes a request's blocks one step after it handed the params on
    pair.producer.expose("p", [2])
    assert wait_done(pair.consumer, "d")
    pair.consumer.release(pair.peer, "p")
    deadline = time.monotonic() + 10
    while "p" not in pair.producer.poll().released:
        assert time.monotonic() < deadline, "the release never arrived"
        time.sleep(0.005)


@pytest.mark.parametrize("case", ["layout", "engine id", "withdrawn", "not held"])
def test_refused_reads_fail_with_the_reason(pair, case, caplog):
    pair.producer.expose("p", [1, 2])
    consumer, sink = pair.consumer, pair.sink
    if case == "layout":  # a decode instance whose blocks are wider
        sink = caches(width=5, dtype=torch.bfloat16)
        consumer = transport(sink, "decode-2")
    if case == "withdrawn":
        pair.producer.withdraw("p")
    remote = (1, 3) if case == "not held" else (1, 2)
    peer = Peer("someone-else", pair.peer.host, pair.peer.port) if case == "engine id" else pair.peer
    started = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="engine_kvconnectors_p2p.transport"):
            consumer.read(Read("d", peer, "p", remote, (4, 5)))
            assert wait_done(consumer, "d") is False
    finally:
        if consumer is not pair.consumer:
            consumer.close()
    assert time.monotonic() - started < 4, "refused at once, not after the timeout"
    reason = {
        "layout": "block_shape",
        "engine id": "prefill-1",
        "withdrawn": "freed",
        "not held": "does not hold",
    }
    assert reason[case] in caplog.text
    assert not sink[0].any(), "a refused read writes nothing"


def test_garbage_on_the_socket_does_not_stop_the_transport(pair):
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    rogue.connect(f"tcp://{pair.peer.host}:{pair.peer.port}")
    for frames in ([b"x"], [b"read", b"\xc1 not msgpack"], [b"read", b"\x80"], [b"release", b"\x91\x01"]):
        rogue.send_multipart(frames)
    rogue.close(linger=1000)
    context.term()
    pair.producer.expose("p", [3])
    pair.consumer.read(Read("d", pair.peer, "p", (3,), (6,)))
    assert wait_done(pair.consumer, "d")


def test_a_dead_producer_fails_the_read_at_once():
    sink = caches()
    consumer = transport(sink, "decode-1", timeout=30)
    try:
        started = time.monotonic()
        consumer.read(Read("d", Peer("gone", "127.0.0.1", free_port()), "p", (1,), (2,)))
        assert wait_done(consumer, "d") is False
        assert time.monotonic() - started < 5, "the refused connection fails it, not the 30 s timeout"
    finally:
        consumer.close()


class _Connector(PDConnector):
    transport_class = ZmqTransport


@pytest.mark.parametrize(
    ("transfer", "extra", "message"),
    [
        ({"kv_role": "kv_producer", "kv_port": 0}, {}, "kv_port"),
        ({}, {"abort_request_timeout": 0}, "abort_request_timeout"),
        ({}, {"transfer_timeout": "soon"}, "transfer_timeout"),
        ({}, {"cpu_bytes": 1}, "unknown key"),
    ],
)
def test_bad_configuration_is_refused_naming_the_key(transfer, extra, message):
    from engine.config import EngineConfig
    from engine.core.kv_connectors import connector_spec
    from engine.interfaces import SCHEDULER_ROLE, KVConnectorContext

    config = EngineConfig.from_kwargs(
        kv_transfer_config={"kv_connector": "p2p", **transfer, "kv_connector_extra_config": extra}
    )
    spec = connector_spec(config)
    with pytest.raises(ValueError, match=message):
        _Connector(
            KVConnectorContext(
                config,
                SCHEDULER_ROLE,
                4,
                2,
                96,
                spec.kv_role,
                spec.extra_config,
                "e",
                spec.kv_ip,
                spec.kv_port,
            )
        )
