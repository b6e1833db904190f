"""CPU time of one step's LoRA kernels as a native tape replays them: cpu-native's shrink and
expand for every LoRA layer of the default model's shapes (30 layers of qkv 576 -> 576|192|192,
o 576 -> 576, gate|up 576 -> 2 x 1536, down 1536 -> 576), one adapter of rank 16 in rank-16
slots on every row, recorded onto two native tapes (the shrinks, the expands) and replayed step
after step. Between steps a 128 MB buffer is read, as a step's base matmuls do, so the adapter's
A and B come from memory, not the caches. One thread; times by the process's CPU clock.

    python benchmarks/lora_step_kernels.py [--rows 8] [--steps 200] [--warm]

Run it with PYTHONPATH on two trees, alternated, to compare their kernels.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

LAYERS = 30
SHAPES = ((576, (576, 192, 192)), (576, (576,)), (576, (1536, 1536)), (1536, (576,)))
RANK, SLOTS = 16, 4


def layer_calls(ops, rows: int):
    """One layer's shrink and expand calls (as ``forward`` functions to record)."""
    calls = []
    for cols, sizes in SHAPES:
        a = torch.randn(SLOTS, len(sizes), RANK, cols).bfloat16() * 0.02
        b = torch.randn(SLOTS, RANK, sum(sizes)).bfloat16() * 0.02
        scale, ranks = torch.ones(SLOTS, len(sizes)), torch.full((SLOTS, len(sizes)), RANK)
        x, y = torch.randn(rows, cols).bfloat16(), torch.randn(rows, sum(sizes)).bfloat16()
        indices = torch.zeros(rows, dtype=torch.long)
        h = ops.lora_shrink(x, a, scale, indices, ranks)
        calls.append(
            (
                functools.partial(ops.lora_shrink, x, a, scale, indices, ranks),
                functools.partial(ops.lora_expand, y, h, b, indices, sizes),
            )
        )
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows", type=int, default=8, help="rows of the step, all on the adapter (default 8)"
    )
    parser.add_argument("--steps", type=int, default=200, help="steps replayed (default 200)")
    parser.add_argument("--warm", action="store_true", help="no buffer read between steps")
    args = parser.parse_args()

    from engine.native.tape import record
    from engine_platforms_cpu_native.platform import NativeCpuPlatform

    torch.set_num_threads(1)
    ops = NativeCpuPlatform().layer_ops(torch.bfloat16)
    calls = [call for _ in range(LAYERS) for call in layer_calls(ops, args.rows)]
    shrinks, _ = record(lambda: [shrink() for shrink, _ in calls][-1])
    expands, _ = record(lambda: [expand() for _, expand in calls][-1])
    evict = torch.ones(32 * 1024 * 1024)
    spent = {"shrink": 0.0, "expand": 0.0}
    for _ in range(args.steps):
        if not args.warm:
            evict.sum()
        for name, tape in (("shrink", shrinks), ("expand", expands)):
            start = time.process_time()
            tape.replay()
            spent[name] += time.process_time() - start
    per_step = {name: seconds / args.steps * 1e3 for name, seconds in spent.items()}
    print(
        f"{args.rows} rows, {LAYERS} layers, rank {RANK}: shrink {per_step['shrink']:.3f} ms, "
        f"expand {per_step['expand']:.3f} ms, both {sum(per_step.values()):.3f} ms per step (CPU time)"
    )


if __name__ == "__main__":
    main()
