"""Quantized matmul kernels side by side on the default model's shapes (and the 1B-class model's
with ``--shapes 1b-…``): torch's int4pack planes (``Int4Planes``, the exact path), the bf16 GEMM
on the dequantized weight as the bf16 config holds it (prepacked for oneDNN where this CPU
computes bfloat16, else ``F.linear``), the cpu-native int8 kernel (``PackedAffine`` with the
tiles off: int8 activations × 4/8-bit weights) and, on a CPU with AMX, cpu-native's tiles
(``PackedAffine.tiles``: bf16 activations × the weight dequantized on the fly), at M = 1, 16,
64, 256 rows.

    python benchmarks/quant_matmul.py [--rows 1 16 64 256] [--repeats 15] [--threads N]
                                      [--layers 1] [--shapes qkv o ... 1b-down]

Random weights in the formats SmolLM2-135M-Instruct.Q4_1.gguf uses: Q4_1 (4-bit, per-group
min) for the projections, Q8_0 for the tied LM head. The kernels run interleaved (A B C A B C …)
on the same inputs; each figure is the median over ``--repeats`` rounds. ``--layers N`` gives
each kernel N weights of the shape and times a call over all of them, per weight: with enough
(60 for the default model's shapes) they no longer fit the caches and come from memory, as in
a decode step, where a kernel that reads fewer bytes gains.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine.layers.dense import PackedDense, packable
from engine.layers.group_affine import AffineWeight, Int4Planes
from engine_platforms_cpu_native import affine
from engine_platforms_cpu_native.affine import PackedAffine

SHAPES = {
    "qkv": (960, 576, 4),
    "o": (576, 576, 4),
    "gate_up": (3072, 576, 4),
    "down": (576, 1536, 4),
    "lm_head": (49152, 576, 8),
    "1b-qkv": (3072, 2048, 4),
    "1b-o": (2048, 2048, 4),
    "1b-gate_up": (16384, 2048, 4),
    "1b-down": (2048, 8192, 4),
}


def random_weight(n: int, k: int, bits: int, gen) -> AffineWeight:
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02
    offset = -scale * 2 ** (bits - 1) if bits == 8 else -torch.rand(n, k // 32, generator=gen) * 0.1
    return AffineWeight(q, scale, offset, 32, bits)


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
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--layers", type=int, default=1, help="weights per kernel, each call runs them all")
    parser.add_argument(
        "--shapes", nargs="+", default=[s for s in SHAPES if not s.startswith("1b")], choices=list(SHAPES)
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    names = ["int4pack", "bf16", "int8", *(["tiles"] if affine.amx_tiles() else [])]
    print(
        f"threads {torch.get_num_threads()}, {args.layers} weight(s) a call; µs per weight, median of"
        f" {args.repeats}; ratios: bf16 time / kernel time"
    )
    print(
        f"{'shape':>10} {'N×K':>11} {'M':>4} " + "".join(f"{n:>10}" for n in names)
        + "".join(f"{'bf16/' + n:>12}" for n in names[2:])
    )  # fmt: skip
    for name in args.shapes:
        n, k, bits = SHAPES[name]
        kernels = {key: [] for key in names}
        for _ in range(args.layers):
            weight = random_weight(n, k, bits, gen)
            for key, fn in kernel_set(weight, names).items():
                kernels[key].append(fn)
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            times = {key: [] for key in kernels}
            for _ in range(args.repeats):
                for key, fns in kernels.items():
                    times[key].append(timed(lambda x, fns=fns: [fn(x) for fn in fns], x) / args.layers)
            med = {key: statistics.median(t) * 1e6 for key, t in times.items()}
            print(
                f"{name:>10} {f'{n}×{k}':>11} {m:>4} " + "".join(f"{med[key]:>10.1f}" for key in names)
                + "".join(f"{med['bf16'] / med[key]:>11.2f}×" for key in names[2:])
            )  # fmt: skip


def kernel_set(weight: AffineWeight, names: list[str]) -> dict:
    """Each kernel of ``names`` holding ``weight``."""
    dense = weight.dequantize(torch.bfloat16)
    kernels = {
        "int4pack": lambda: Int4Planes(weight, torch.bfloat16),
        "bf16": lambda: PackedDense(dense) if packable(dense) else (lambda x: F.linear(x, dense)),
        "int8": lambda: PackedAffine(weight, torch.bfloat16, tiles=False),
        "tiles": lambda: PackedAffine(weight, torch.bfloat16).tiles,
    }
    return {key: kernels[key]() for key in names}


if __name__ == "__main__":
    main()
