"""One prompt's KV blocks pulled from a prefill process into a decode process, through each P/D
transport (``engine.kv_transfer.Transport``) side by side in one run: NIXL (kvconnectors-nixl,
one-sided READ over UCX) and ZMQ/TCP (kvconnectors-p2p, the blocks sent in the reply).

    python benchmarks/pd_transfer.py [--tokens 2048] [--reps 10] [--dtype float32] [--transports nixl p2p]

The caches have SmolLM2-135M's KV shape (30 layers, 3 KV heads, head_dim 64, block 16, the torch
backend's layout). Per transport, a child process is the prefill instance: it exposes one request
per repetition on the same blocks; this process is the decode instance and reads each into other
block ids. The first read (the handshake, for NIXL the peer's metadata and descriptors) is timed on
its own; the median of the rest is printed with its throughput, and every read is checked bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import textwrap
import time

import torch

from engine.testing.ports import free_port

LAYERS, KV_HEADS, HEAD_DIM, BLOCK, BLOCK_DIM = 30, 3, 64, 16, 2
TRANSPORTS = {
    "nixl": "engine_kvconnectors_nixl.transport:NixlTransport",
    "p2p": "engine_kvconnectors_p2p.transport:ZmqTransport",
}

CHILD = """
    import sys, time, torch
    sys.path.insert(0, {here!r})
    from pd_transfer import caches, make
    kv = caches({blocks}, {dtype!r}, fill=True)
    prefill = make({target!r}, "prefill", kv, serves=True, port={port})
    for rep in range({reps}):
        prefill.expose(f"r{{rep}}", list(range({count})))
    print("ready", flush=True)
    released = set()
    while len(released) < {reps}:
        released |= prefill.poll().released
        time.sleep(0.001)
    prefill.close()
"""


def caches(num_blocks: int, dtype: str, fill: bool = False) -> list[torch.Tensor]:
    shape = (2, KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.randn(shape, generator=generator) if fill else torch.zeros(shape)).to(getattr(torch, dtype))
        for _ in range(LAYERS)
    ]


def make(target: str, engine_id: str, kv, serves: bool, port: int = 0):
    import importlib

    from engine.kv_transfer import BlockLayout, TransportContext

    module, name = target.split(":")
    cls = getattr(importlib.import_module(module), name)
    transport = cls(
        TransportContext(engine_id, "127.0.0.1", port, serves, BlockLayout.of(kv, BLOCK_DIM, BLOCK), 60.0)
    )
    transport.start(kv, BLOCK_DIM)
    return transport


def run(name: str, tokens: int, reps: int, dtype: str) -> tuple[float, list[float]]:
    from engine.kv_transfer import Peer, Read

    count = tokens // BLOCK
    port = free_port()
    source = CHILD.format(
        here=sys.path[0],
        blocks=count + 4,
        dtype=dtype,
        target=TRANSPORTS[name],
        port=port,
        reps=reps,
        count=count,
    )
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(source)], stdout=subprocess.PIPE, text=True
    )
    try:
        for line in child.stdout:
            if line.strip() == "ready":
                break
        kv = caches(2 * count + 4, dtype)
        decode = make(TRANSPORTS[name], "decode", kv, serves=False)
        want = caches(count + 4, dtype, fill=True)
        peer, times = Peer("prefill", "127.0.0.1", port), []
        local = tuple(range(count + 4, 2 * count + 4))  # other block ids than the prefill side's
        for rep in range(reps):
            started = time.perf_counter()
            decode.read(Read(f"d{rep}", peer, f"r{rep}", tuple(range(count)), local))
            while not (done := decode.poll().reads_done):
                time.sleep(0.0002)
            times.append(time.perf_counter() - started)
            assert done == {f"d{rep}": True}, done
            for mine, theirs in zip(kv, want):
                assert torch.equal(mine[:, :, count + 4 :], theirs[:, :, :count]), "not bit-identical"
            decode.release(peer, f"r{rep}")
        decode.close()
        child.wait(60)
    finally:
        child.kill()
    return times[0], times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=list(TRANSPORTS))
    args = parser.parse_args()
    nbytes = (
        args.tokens
        // BLOCK
        * LAYERS
        * 2
        * KV_HEADS
        * BLOCK
        * HEAD_DIM
        * torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    )
    print(f"{args.tokens} tokens of SmolLM2-135M KV ({args.dtype}): {nbytes / 2**20:.1f} MiB per read")
    for name in args.transports:
        first, rest = run(name, args.tokens, args.reps, args.dtype)
        median = statistics.median(rest)
        print(
            f"{name:5s} first read {first * 1e3:8.1f} ms   median {median * 1e3:7.1f} ms   "
            f"{nbytes / median / 2**30:5.2f} GiB/s"
        )


if __name__ == "__main__":
    main()
