"""bfloat16 weights on a CPU without native bfloat16 (AVX2 + FMA: no AVX512_BF16, no AMX), side by
side: torch's ``F.linear`` in bfloat16 (oneDNN's emulation: what such a CPU ran before) against
cpu-native's :class:`~engine_platforms_cpu_native.dense.WidenedBf16` (weights widened to float32
as ``dense_bf16.c`` reads them).

    python benchmarks/bf16_matmul.py [--rows 1 4 16 64 256] [--repeats 7] [--threads N]

Random weights in the default model's (SmolLM2-135M) and a 1B-class model's (Llama-3.2-1B)
projection shapes. The two run interleaved (A B A B …) on the same inputs; each figure is
the median over ``--repeats`` rounds, the ratio F.linear's time over the kernel's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine_platforms_cpu_native.dense import WidenedBf16

SHAPES = [(576, 576), (1536, 576), (576, 1536), (2048, 2048), (8192, 2048), (2048, 8192)]


def timed(fn, x, min_seconds=0.02) -> float:
    """Seconds per call, calls repeated until ``min_seconds`` pass."""
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or calls < 2:
        fn(x)
        calls += 1
    return elapsed / calls


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(
        f"threads {torch.get_num_threads()}; µs per call, median of {args.repeats}; ratio: F.linear / kernel"
    )
    print(f"{'N×K':>10} {'M':>4} {'F.linear':>10} {'kernel':>10} {'ratio':>7}")
    for n, k in SHAPES:
        weight = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
        paths = {
            "F.linear": lambda x, w=weight: F.linear(x, w),
            "kernel": WidenedBf16(weight, torch.bfloat16),
        }
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            times: dict[str, list[float]] = {key: [] for key in paths}
            for _ in range(args.repeats):
                for key, fn in paths.items():
                    times[key].append(timed(fn, x))
            med = {key: statistics.median(t) * 1e6 for key, t in times.items()}
            print(
                f"{f'{n}×{k}':>10} {m:>4} {med['F.linear']:>10.1f} {med['kernel']:>10.1f} "
                f"{med['F.linear'] / med['kernel']:>6.2f}×",
                flush=True,
            )


if __name__ == "__main__":
    main()
