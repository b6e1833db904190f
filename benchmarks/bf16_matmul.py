"""bfloat16 weights on cpu-native's kernels, side by side. On a CPU without native bfloat16 (AVX2 +
FMA: no AVX512_BF16, no AMX): torch's ``F.linear`` in bfloat16 (oneDNN's emulation: what such a
CPU ran before) against :class:`~engine_platforms_cpu_native.dense.WidenedBf16` (weights widened
to float32 as ``dense_bf16.c`` reads them). With ``--tiles``, on a CPU with AMX tiles: oneDNN's
prepacked GEMM (:class:`engine.layers.dense.PackedDense`, what such a CPU ran before) against
:class:`~engine_platforms_cpu_native.dense.TiledBf16` (``dense_bf16_amx.h``).

    python benchmarks/bf16_matmul.py [--rows 1 4 16 64 256] [--repeats 7] [--threads N] [--fused]
                                     [--against OTHER_TREE/.../dense_bf16.c | --tiles] [--from-memory MIB]

Random weights in the default model's (SmolLM2-135M) and a 1B-class model's (Llama-3.2-1B)
projection shapes, or with ``--fused`` the calls the engine makes (q|k|v and gate|up fused).
``--against`` times the kernel against another build of it (another tree's ``dense_bf16.c``, e.g.
an export of the previous commit) in place of F.linear, and stops if the two give other bits.
``--from-memory MIB`` cycles each path through copies of each weight adding up to MIB (more than
the L3), so that a call reads its weight from memory as a decode step's does, not from cache. The
two run interleaved (A B A B …) on the same inputs; each figure is the median over ``--repeats``
rounds, the ratio the other path's time over the kernel's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.layers.dense import PackedDense
from engine.native import load_source
from engine.native.tape import bind
from engine_platforms_cpu_native.dense import TiledBf16, WidenedBf16, amx_tiles

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


def cycled(paths: list) -> Callable[[torch.Tensor], torch.Tensor]:
    """x ↦ each of ``paths`` (one per copy of the weight) applied to x in turn; the last result."""

    def run(x: torch.Tensor) -> torch.Tensor:
        for path in paths:
            out = path(x)
        return out

    return run


def layer_paths(args, other: str, weight: torch.Tensor) -> dict:
    """{other: the path compared, "kernel": cpu-native's} for one copy of ``weight``."""
    if args.tiles:
        return {other: PackedDense(weight), "kernel": TiledBf16(weight)}
    compared = other_build(args.against, weight) if args.against else lambda x, w=weight: F.linear(x, w)
    return {other: compared, "kernel": WidenedBf16(weight, torch.bfloat16)}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="rows (M)")
    parser.add_argument("--repeats", type=int, default=7, help="rounds; each figure is their median")
    parser.add_argument("--threads", type=int, default=None, help="threads (default: torch's)")
    parser.add_argument("--fused", action="store_true", help="the engine's fused projection shapes")
    parser.add_argument("--against", type=Path, help="another dense_bf16.c, timed in place of F.linear")
    parser.add_argument(
        "--tiles", action="store_true", help="AMX CPUs: TiledBf16 against oneDNN's prepacked GEMM"
    )
    parser.add_argument(
        "--from-memory", type=int, metavar="MIB", help="cycle copies of each weight adding up to MIB"
    )
    args = parser.parse_args()
    if args.tiles and not amx_tiles():
        raise SystemExit("--tiles: this CPU (or ENGINE_CPU_AMX_TILES=0) has no AMX tiles")
    if args.threads:
        torch.set_num_threads(args.threads)
    other = "other" if args.against else "oneDNN" if args.tiles else "F.linear"
    gen = torch.Generator().manual_seed(0)
    print(
        f"threads {torch.get_num_threads()}; µs per call, median of {args.repeats}; ratio: {other} / kernel"
    )
    print(f"{'N×K':>11} {'M':>4} {other:>10} {'kernel':>10} {'ratio':>7}")
    for n, k in FUSED_SHAPES if args.fused else SHAPES:
        layers = max(1, (args.from_memory or 0) * 2**20 // (n * k * 2))
        copies = [
            layer_paths(args, other, (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16))
            for _ in range(layers)
        ]
        paths = {key: cycled([copy[key] for copy in copies]) for key in (other, "kernel")}
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            if args.against and not torch.equal(paths[other](x), paths["kernel"](x)):
                raise SystemExit(f"{n}×{k}, {m} rows: the two builds give other bits")
            times: dict[str, list[float]] = {key: [] for key in paths}
            for _ in range(args.repeats):
                for key, fn in paths.items():
                    times[key].append(timed(fn, x) / layers)
            med = {key: statistics.median(t) * 1e6 for key, t in times.items()}
            print(
                f"{f'{n}×{k}':>11} {m:>4} {med[other]:>10.1f} {med['kernel']:>10.1f} "
                f"{med[other] / med['kernel']:>6.2f}×",
                flush=True,
            )


if __name__ == "__main__":
    main()
