"""bfloat16 weights on a CPU without native bfloat16 (AVX2 + FMA: no AVX512_BF16, no AMX), side by
side: torch's ``F.linear`` in bfloat16 (oneDNN's emulation: what such a CPU ran before) against
cpu-native's :class:`~engine_platforms_cpu_native.dense.WidenedBf16` (weights widened to float32
as ``dense_bf16.c`` reads them).

    python benchmarks/bf16_matmul.py [--rows 1 4 16 64 256] [--repeats 7] [--threads N]
                                     [--fused] [--against OTHER_TREE/.../dense_bf16.c]

Random weights in the default model's (SmolLM2-135M) and a 1B-class model's (Llama-3.2-1B)
projection shapes, or with ``--fused`` the calls the engine makes (q|k|v and gate|up fused).
``--against`` times the kernel against another build of it (another tree's ``dense_bf16.c``, e.g.
an export of the previous commit) in place of F.linear, and stops if the two give other bits.
The two run interleaved (A B A B …) on the same inputs; each figure is the median over
``--repeats`` rounds, the ratio the other path's time over the kernel's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.native import load_source
from engine.native.tape import bind
from engine_platforms_cpu_native.dense import WidenedBf16

SHAPES = [(576, 576), (1536, 576), (576, 1536), (2048, 2048), (8192, 2048), (2048, 8192)]
# q|k|v, o, gate|up and down, N×K: the default model's, then the 1B-class one's
FUSED_SHAPES = [
    (960, 576),
    (576, 576),
    (3072, 576),
    (576, 1536),
    (3072, 2048),
    (2048, 2048),
    (16384, 2048),
    (2048, 8192),
]


def timed(fn, x, min_seconds=0.02) -> float:
    """Seconds per call, calls repeated until ``min_seconds`` pass."""
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or calls < 2:
        fn(x)
        calls += 1
    return elapsed / calls


def other_build(source: Path, weight: torch.Tensor):
    """x ↦ x · weightᵀ in bfloat16 by the ``dense_bf16.c`` at ``source`` (another tree's)."""
    matmul = bind(load_source(source), "dense_matmul_bf16")
    n, k = weight.shape

    def run(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        matmul(x.data_ptr(), x.stride(0), x.shape[0], k, weight.data_ptr(), 0, n, out.data_ptr())
        return out

    return run


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--fused", action="store_true", help="the engine's fused projection shapes")
    parser.add_argument("--against", type=Path, help="another dense_bf16.c, timed in place of F.linear")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    other = "other" if args.against else "F.linear"
    gen = torch.Generator().manual_seed(0)
    print(
        f"threads {torch.get_num_threads()}; µs per call, median of {args.repeats}; ratio: {other} / kernel"
    )
    print(f"{'N×K':>11} {'M':>4} {other:>10} {'kernel':>10} {'ratio':>7}")
    for n, k in FUSED_SHAPES if args.fused else SHAPES:
        weight = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
        paths = {
            other: other_build(args.against, weight) if args.against else lambda x, w=weight: F.linear(x, w),
            "kernel": WidenedBf16(weight, torch.bfloat16),
        }
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            if args.against and not torch.equal(paths[other](x), paths["kernel"](x)):
                raise SystemExit(f"{n}×{k}, {m} rows: the two builds give other bits")
            times: dict[str, list[float]] = {key: [] for key in paths}
            for _ in range(args.repeats):
                for key, fn in paths.items():
                    times[key].append(timed(fn, x))
            med = {key: statistics.median(t) * 1e6 for key, t in times.items()}
            print(
                f"{f'{n}×{k}':>11} {m:>4} {med[other]:>10.1f} {med['kernel']:>10.1f} "
                f"{med[other] / med['kernel']:>6.2f}×",
                flush=True,
            )


if __name__ == "__main__":
    main()
