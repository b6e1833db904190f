"""NVFP4 weights side by side: the cpu-native FP4 kernel (``PackedFp4``: e2m1 codes and float
block scales decoded inside the matmul) against the fallback it replaces, the weight
dequantized at load to bfloat16 and multiplied by the platform's dense matmul (``pack_dense``,
oneDNN's blocked layout where it takes it, else ``F.linear``), at decode-sized M.

    python benchmarks/nvfp4_matmul.py [--rows 1 4 16 64] [--repeats 15] [--threads N]

Random NVFP4 weights (codes and float8 block scales over a global scale) in Qwen3-0.6B's
projection shapes. The two run interleaved (A B A B …) on the same inputs; each figure is the
median over ``--repeats`` rounds, the ratio the dense time over the kernel's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine.layers.fp4 import Fp4Weight
from engine_platforms_cpu_native.fp4 import PackedFp4
from engine_platforms_cpu_native.platform import NativeCpuPlatform

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def random_nvfp4(n: int, k: int, gen) -> Fp4Weight:
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    e4m3 = (torch.rand(n, k // 16, generator=gen) * 448).to(torch.float8_e4m3fn)
    return Fp4Weight(codes, e4m3.float() / 5000.0, 16)


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
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    ops = NativeCpuPlatform().layer_ops(torch.bfloat16)
    print(f"threads {torch.get_num_threads()}; µs per call, median of {args.repeats}; ratio: dense / fp4")
    print(f"{'shape':>8} {'N×K':>10} {'M':>4} {'fp4':>10} {'dense':>10} {'ratio':>7}")
    for name, (n, k) in SHAPES.items():
        weight = random_nvfp4(n, k, gen)
        dense = weight.dequantize(torch.bfloat16)
        kernels = {"fp4": PackedFp4(weight, torch.bfloat16), "dense": ops.pack_dense(dense)}
        if kernels["dense"] is None:
            kernels["dense"] = lambda x, w=dense: F.linear(x, w)
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            times: dict[str, list[float]] = {key: [] for key in kernels}
            for _ in range(args.repeats):
                for key, fn in kernels.items():
                    times[key].append(timed(fn, x))
            med = {key: statistics.median(t) * 1e6 for key, t in times.items()}
            print(
                f"{name:>8} {f'{n}×{k}':>10} {m:>4} {med['fp4']:>10.1f} {med['dense']:>10.1f} "
                f"{med['dense'] / med['fp4']:>6.2f}×"
            )


if __name__ == "__main__":
    main()
