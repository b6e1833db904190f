"""The KV pool's allocation at start-up, side by side in one process: ``torch.zeros`` (what the
engine did) against the CPU platform's ``allocate_zeroed`` (fresh zero pages from the kernel),
interleaved A B A B, with the resident memory each leaves.

    python benchmarks/kv_allocation.py [--gib 5] [--layers 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from engine.builtin.platforms import CpuPlatform
from engine.core.startup import resident_bytes


def allocate(how: str, layers: int, per_layer: int) -> tuple[float, int]:
    """(seconds to allocate ``layers`` bf16 caches of ``per_layer`` bytes, resident bytes they add)."""
    gc.collect()
    before = resident_bytes()
    started = time.perf_counter()
    shape = (per_layer // 2,)
    if how == "torch.zeros":
        caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(layers)]
    else:
        caches = [CpuPlatform().allocate_zeroed(shape, torch.bfloat16) for _ in range(layers)]
    seconds = time.perf_counter() - started
    added = resident_bytes() - before
    del caches
    return seconds, added


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=5.0, help="the pool's size in GiB (default 5)")
    parser.add_argument("--layers", type=int, default=30, help="one cache tensor per layer (default 30)")
    parser.add_argument("--repeats", type=int, default=3, help="A B rounds (default 3)")
    args = parser.parse_args()
    per_layer = int(args.gib * 2**30 / args.layers)
    results: dict[str, list[tuple[float, int]]] = {"torch.zeros": [], "allocate_zeroed": []}
    for _ in range(args.repeats):
        for how, runs in results.items():
            runs.append(allocate(how, args.layers, per_layer))
    for how, runs in results.items():
        best = min(s for s, _ in runs)
        resident = max(r for _, r in runs) / 2**30
        print(f"{how:16} best {best:7.3f} s   resident after {resident:5.2f} GiB")
    zeros, mapped = (min(s for s, _ in results[h]) for h in results)
    pool = f"a {args.gib:g} GiB pool in {args.layers} tensors"
    print(f"allocate_zeroed is {zeros / mapped:.0f}x faster for {pool}")


if __name__ == "__main__":
    main()
