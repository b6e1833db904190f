"""Decode-step attention on a CUDA device: the triton, flash-attn and torch backends side by
side, eager and (for a backend declaring ``cuda_graph_support``) replayed from a CUDA graph.

    python benchmarks/gpu_attention.py [--batches 1 32 256] [--contexts 512 4096] [--repeats 30]

One layer's attention call (this step's K/V written, then attended) on a Llama-3-8B layer's
shape (32 query heads, 8 KV heads, head_dim 128, bf16, block size 16), every request decoding
one token over the given context, blocks shuffled over the pool. Calls alternate between the
variants on the same inputs (A B C A B C ...), each timed with CUDA events; the median of
each is printed with its ratio to torch. Needs a CUDA device (it exits with a message
without one); not yet run on one.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from engine.builtin.platforms import CudaPlatform
from engine.interfaces import AttentionSpec, BatchLayout
from engine.plugins import load_plugins

SPEC = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
BACKENDS = ("torch", "triton", "flash-attn")


def decode_inputs(batch: int, context: int, gen: torch.Generator, device: str):
    """A decode layout for ``batch`` requests at ``context`` tokens (the new one included),
    their blocks a random permutation of the pool, and the step's q, k, v."""
    bs = SPEC.block_size
    per_request = -(-context // bs)
    tables = (torch.randperm(batch * per_request, generator=gen) + 1).view(batch, per_request).int()
    slots = tables[:, (context - 1) // bs].long() * bs + (context - 1) % bs
    layout = BatchLayout(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_table=tables.to(device),
        slot_mapping=slots.to(device),
        query_lens=(1,) * batch,
        seq_lens_host=(context,) * batch,
    )
    q, k, v = (
        torch.randn(batch, h, SPEC.head_dim, generator=gen).to(device, SPEC.dtype)
        for h in (SPEC.num_heads, SPEC.num_kv_heads, SPEC.num_kv_heads)
    )
    return layout, q, k, v, batch * per_request + 1


def variants(batch: int, context: int, device: str):
    """name -> a zero-argument callable running one attention call."""
    platform, registry = CudaPlatform(), load_plugins()
    layout, q, k, v, pool = decode_inputs(
        batch, context, torch.Generator().manual_seed(batch + context), device
    )
    out = {}
    for name in BACKENDS:
        cls = registry.get("attention_backends", name)
        if cls.supports(SPEC, platform):
            print(f"  {name}: skipped ({'; '.join(cls.supports(SPEC, platform))})")
            continue
        backend = cls(SPEC, platform)
        cache = torch.zeros(backend.kv_cache_shape(pool), dtype=SPEC.dtype, device=device)
        metadata = backend.build_metadata(layout)

        def call(backend=backend, cache=cache, metadata=metadata):
            return backend.forward(q, k, v, cache, metadata)

        out[name] = call
        if cls.cuda_graph_support != "none":
            call()  # compile before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            out[f"{name}+graph"] = graph.replay
    return out


def time_interleaved(calls: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds per call, the calls alternating."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_attention.py: needs a CUDA device", file=sys.stderr)
        return 1
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {SPEC}")
    print("| batch | context | " + " | ".join(f"{n} ms" for n in BACKENDS) + " | graphs ms | vs torch |")
    for batch in args.batches:
        for context in args.contexts:
            medians = time_interleaved(variants(batch, context, "cuda"), args.repeats)
            base = medians.get("torch")
            cells = [f"{medians[n]:.3f}" if n in medians else "—" for n in BACKENDS]
            graphs = ", ".join(f"{n}: {m:.3f}" for n, m in medians.items() if n.endswith("+graph")) or "—"
            ratios = ", ".join(f"{n} {base / m:.2f}×" for n, m in medians.items() if base and n != "torch")
            print(f"| {batch} | {context} | " + " | ".join(cells) + f" | {graphs} | {ratios} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
