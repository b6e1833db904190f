"""Decode attention under a sliding window against full attention, side by side in one run.

    python benchmarks/sliding_window.py [--batches 1 16 64] [--contexts 1024 4096] [--window 512]
                                        [--repeats 15] [--threads N]

One layer's decode attention call (this step's K/V written, then attended) on the shape of
``benchmarks/attention.py`` (9 query heads, 3 KV heads, head_dim 64, block size 16, bf16), each
backend with and without ``sliding_window``, on the same inputs, calls interleaved (full,
window, full, window ...); the median of each and their ratio. A backend that starts at the
window's first block reads ``window`` keys however long the context.
"""

from __future__ import annotations

import argparse
import functools

import attrs
import torch
from attention import BACKENDS, SPEC, decode_inputs, time_calls

from engine.builtin.platforms import CpuPlatform
from engine.plugins import load_plugins


def compare(batches, contexts, window: int, repeats: int) -> None:
    registry, platform, gen = load_plugins(), CpuPlatform(), torch.Generator().manual_seed(0)
    windowed = attrs.evolve(SPEC, sliding_window=window)
    print(
        f"one layer's decode attention, {SPEC}, window {window}, {torch.get_num_threads()} threads, "
        f"median of {repeats}"
    )
    print(f"{'backend':>10} {'batch':>5} {'context':>7} {'full µs':>9} {'window µs':>10} {'ratio':>6}")
    for name in BACKENDS:
        cls = registry.get("attention_backends", name)
        backends = {
            kind: cls(spec, platform, registry=registry)
            for kind, spec in (("full", SPEC), ("window", windowed))
        }
        for batch in batches:
            for context in contexts:
                layout, pool, (q, k, v) = decode_inputs(batch, context, gen)
                cache = torch.randn(backends["full"].kv_cache_shape(pool), generator=gen).to(SPEC.dtype)
                calls = {
                    kind: functools.partial(b.forward, q, k, v, cache, b.build_metadata(layout))
                    for kind, b in backends.items()
                }
                medians = time_calls(calls, repeats)
                full, win = medians["full"] * 1e6, medians["window"] * 1e6
                print(f"{name:>10} {batch:>5} {context:>7} {full:>9.0f} {win:>10.0f} {full / win:>5.2f}x")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, help="torch (and OpenMP) threads; default: torch's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    compare(args.batches, args.contexts, args.window, args.repeats)


if __name__ == "__main__":
    main()
