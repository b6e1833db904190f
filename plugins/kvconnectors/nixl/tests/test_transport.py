"""NixlTransport on its own, over real NIXL (UCX, host memory): a prefill process's bf16 blocks
read into other block ids of this process bit for bit; a layout or engine-id mismatch refused
naming the field; a lease held by a killed decode process does not hold up ``withdraw``; a READ
NIXL fails (the peer's agent gone after the grant) is a failed read, and the transport goes on."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.kv_transfer import BlockLayout, Peer, Read, TransportContext
from engine.testing.ports import free_port
from engine_kvconnectors_nixl import nixl_api
from engine_kvconnectors_nixl.transport import NixlTransport

pytestmark = pytest.mark.skipif(nixl_api.missing_reason() is not None, reason=str(nixl_api.missing_reason()))

BLOCK_DIM = 2  # the torch attention backend's [2, kv_heads, blocks, block_size, head_dim]
SEED = 7


def caches(
    num_blocks: int,
    kv_heads: int = 2,
    block_size: int = 4,
    dtype=torch.bfloat16,
    fill: bool = False,
    layers: int = 3,
):
    """Paged caches, one per layer: random (the prefill side's, reproducible) or zeros."""
    generator = torch.Generator().manual_seed(SEED)
    shape = (2, kv_heads, num_blocks, block_size, 8)
    return [
        torch.randn(shape, generator=generator).to(dtype) if fill else torch.zeros(shape, dtype=dtype)
        for _ in range(layers)
    ]


def transport(engine_id: str, kv_caches, serves: bool, port: int = 0, timeout: float = 10.0):
    ctx = TransportContext(
        engine_id,
        "127.0.0.1",
        port,
        serves,
        BlockLayout.of(kv_caches, BLOCK_DIM, kv_caches[0].shape[3]),
        timeout,
    )
    made = NixlTransport(ctx)
    made.start(kv_caches, BLOCK_DIM)
    return made


def wait_for_read(reader, request_id: str, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = reader.poll().reads_done
        if request_id in done:
            return done[request_id]
        time.sleep(0.005)
    raise AssertionError(f"read {request_id} never ended")


def child(source: str) -> subprocess.Popen:
    """A Python process running ``source``."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(source)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def said(process: subprocess.Popen, word: str, timeout: float = 60.0) -> None:
    """Wait for the child to print ``word`` on a line of its own (NIXL logs to stdout too)."""
    heard = threading.Event()

    def listen():
        for line in process.stdout:
            if line.strip() == word:
                heard.set()
                return

    threading.Thread(target=listen, daemon=True).start()
    if not heard.wait(timeout):
        process.kill()
        raise AssertionError(f"the child never said {word!r}: {process.stderr.read()[-3000:]}")


PREFILL = """
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_transport import caches, transport  # this module: the same caches on both sides
    kv = caches(16, fill=True)
    prefill = transport("prefill", kv, serves=True, port={port})
    prefill.expose("req", [5, 2, 9, 11])
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while "req" not in prefill.poll().released and time.monotonic() < deadline:
        time.sleep(0.01)
    prefill.withdraw("req")
    prefill.close()
    print("released", flush=True)
"""


def test_a_prefill_process_blocks_land_in_other_block_ids_bit_for_bit(tmp_path):
    port = free_port()
    prefill = child(PREFILL.format(tests=str(Path(__file__).parent), port=port))
    try:
        said(prefill, "ready")
        kv = caches(12)
        decode = transport("decode", kv, serves=False)
        try:
            peer = Peer("prefill", "127.0.0.1", port)
            decode.read(Read("mine", peer, "req", (5, 2, 9), (0, 7, 3)))
            assert wait_for_read(decode, "mine") is True
            decode.release(peer, "req")
            said(prefill, "released")
        finally:
            decode.close()
    finally:
        prefill.kill()
        prefill.wait(10)
    theirs = caches(16, fill=True)
    for mine, source in zip(kv, theirs):
        got = mine.index_select(BLOCK_DIM, torch.tensor([0, 7, 3]))
        want = source.index_select(BLOCK_DIM, torch.tensor([5, 2, 9]))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "the blocks are not bit-identical"
        untouched = [b for b in range(12) if b not in (0, 7, 3)]
        assert not mine.index_select(BLOCK_DIM, torch.tensor(untouched)).any(), "a block not read was written"


@pytest.mark.parametrize(
    ("decode_kv", "peer_id", "named"),
    [
        (lambda: caches(12, block_size=8), "prefill", "block_size: 4 here vs 8 there"),
        (
            lambda: caches(12, kv_heads=1, dtype=torch.float32),
            "prefill",
            "dtype: 'bfloat16' here vs 'float32' there",
        ),
        (lambda: caches(12, layers=2), "prefill", "num_layers: 3 here vs 2 there"),
        (lambda: caches(12), "another-prefill", "engine id is 'prefill', not 'another-prefill'"),
    ],
    ids=["block_size", "heads-and-dtype", "layers", "engine_id"],
)
def test_a_mismatch_is_refused_naming_it(decode_kv, peer_id, named, caplog):
    port = free_port()
    prefill = transport("prefill", caches(16, fill=True), serves=True, port=port)
    kv = decode_kv()
    decode = transport("decode", kv, serves=False)
    try:
        prefill.expose("req", [1, 2])
        with caplog.at_level(logging.WARNING, logger="engine_kvconnectors_nixl"):
            decode.read(Read("mine", Peer(peer_id, "127.0.0.1", port), "req", (1, 2), (3, 4)))
            assert wait_for_read(decode, "mine") is False
        assert named in caplog.text, caplog.text
        if peer_id == "prefill" and "dtype" in named:
            assert "block_shape: (2, 2, 4, 8) here vs (2, 1, 4, 8) there" in caplog.text  # the kv heads
        assert not any(cache.any() for cache in kv), "a refused read wrote into the cache"
    finally:
        decode.close()
        prefill.close()


HOLDER = """
    import time, torch, zmq
    from engine.kv_transfer import BlockLayout
    from engine_kvconnectors_nixl import wire
    from engine_kvconnectors_nixl.agent import Agent
    from engine_kvconnectors_nixl.regions import Regions
    kv = [torch.zeros(2, 2, 16, 4, 8, dtype=torch.bfloat16) for _ in range(3)]
    agent = Agent("holder", ["UCX"], kv, Regions.of(kv, 2))
    side = zmq.Context().socket(zmq.DEALER)
    side.connect(wire.endpoint("127.0.0.1", {port}))
    side.send_multipart([wire.HELLO, wire.header(engine_id="prefill", agent=agent.name,
                         layout=BlockLayout.of(kv, 2, 4).to_dict()), agent.metadata()])
    assert side.recv_multipart()[0] == wire.HELLO
    side.send_multipart([wire.LEASE, wire.header(id="lease-1", engine_id="prefill", agent=agent.name,
                         request_id="req", block_ids=[5, 2])])
    print(side.recv_multipart()[0].decode(), flush=True)
    time.sleep(600)  # granted, and never reads: a decode instance killed mid-transfer
"""


def test_a_killed_readers_lease_does_not_hold_up_withdraw():
    port = free_port()
    prefill = transport("prefill", caches(16, fill=True), serves=True, port=port, timeout=30.0)
    holder = child(HOLDER.format(port=port))
    try:
        prefill.expose("req", [5, 2, 9])
        said(holder, "grant")
        withdrawn = threading.Event()
        threading.Thread(target=lambda: (prefill.withdraw("req"), withdrawn.set()), daemon=True).start()
        assert not withdrawn.wait(1.0), "withdraw returned while a live reader held a lease on the blocks"
        holder.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        assert withdrawn.wait(10.0), "withdraw waited for the lease of a killed reader"
        assert time.monotonic() - killed < 5.0  # NIXL finds it gone, well before transfer_timeout (30 s)
    finally:
        holder.kill()
        holder.wait(10)
        prefill.close()


@pytest.mark.parametrize(
    ("backends", "named"),
    [
        ("UCX", "kv_connector_extra_config.backends: a list of NIXL backend names"),
        (["NO_SUCH_BACKEND"], "NIXL could not start ['NO_SUCH_BACKEND']"),
    ],
)
def test_unusable_backends_are_refused_naming_the_key(backends, named):
    kv = caches(4)
    ctx = TransportContext(
        "decode", "127.0.0.1", 0, False, BlockLayout.of(kv, BLOCK_DIM, 4), 10.0, {"backends": backends}
    )
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        NixlTransport(ctx).start(kv, BLOCK_DIM)


VANISHING = """
    import gc, time, torch, zmq
    from engine.kv_transfer import BlockLayout
    from engine_kvconnectors_nixl import wire
    from engine_kvconnectors_nixl.agent import Agent
    from engine_kvconnectors_nixl.regions import Regions
    kv = [torch.zeros(2, 2, 16, 4, 8, dtype=torch.bfloat16) for _ in range(3)]
    agent = Agent("prefill", ["UCX"], kv, Regions.of(kv, 2))
    side = zmq.Context().socket(zmq.ROUTER)
    side.bind(wire.endpoint("127.0.0.1", {port}))
    print("ready", flush=True)
    identity = side.recv_multipart()[0]  # the hello
    side.send_multipart([identity, wire.HELLO, wire.header(engine_id="prefill", agent=agent.name,
                         layout=BlockLayout.of(kv, 2, 4).to_dict(), regions=agent.regions.describe()),
                         agent.metadata()])
    identity, _, head = side.recv_multipart()  # the lease
    agent.close()  # NIXL's side is gone; the side channel still grants
    del agent
    gc.collect()
    side.send_multipart([identity, wire.GRANT, wire.header(id=wire.parse(head)["id"])])
    time.sleep(600)
"""


def test_a_transfer_nixl_fails_is_a_failed_read_and_the_transport_goes_on(caplog):
    port = free_port()
    vanishing = child(VANISHING.format(port=port))
    kv = caches(16)
    decode = transport("decode", kv, serves=False, timeout=30.0)
    try:
        said(vanishing, "ready")
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="engine_kvconnectors_nixl"):
            decode.read(Read("mine", Peer("prefill", "127.0.0.1", port), "req", (5, 2), (0, 1)))
            assert wait_for_read(decode, "mine") is False
        assert time.monotonic() - started < 10.0, "a NIXL failure waited for transfer_timeout"
        assert "failed" in caplog.text, caplog.text
        assert not any(cache.any() for cache in kv)
        second = free_port()  # the same transport reads from a healthy prefill process next
        prefill = child(PREFILL.format(tests=str(Path(__file__).parent), port=second))
        try:
            said(prefill, "ready")
            peer = Peer("prefill", "127.0.0.1", second)
            decode.read(Read("again", peer, "req", (5, 2), (0, 1)))
            assert wait_for_read(decode, "again") is True
            decode.release(peer, "req")
            said(prefill, "released")
        finally:
            prefill.kill()
            prefill.wait(10)
    finally:
        decode.close()
        vanishing.kill()
        vanishing.wait(10)
