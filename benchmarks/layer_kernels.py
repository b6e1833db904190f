"""The cpu-native layer kernels of two source trees side by side, per row: the (residual add +)
RMSNorm, the rotary, SwiGLU, W8A8's row quantization and its int32 rescale, in bf16 and float32.

    python benchmarks/layer_kernels.py OLD_KERNELS_DIR [NEW_KERNELS_DIR] [--rows 32] [--threads 1]

Each directory holds a ``kernels.c`` (the plugin's ``engine_platforms_cpu_native`` folder of
another checkout; NEW defaults to this tree's). Both are built and loaded into one process and
called through ctypes on the same tensors, ``--rows`` rows a call (32: the arithmetic, no call
splits over threads; 1: a single-stream token's calls, where the cost of a call's set-up shows),
old and new interleaved, the best of 7 × 2000 calls each, twice. ``--threads`` sets the OpenMP
pool (a call over its split size then splits).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from engine.native import load_source


def best_ns(call, reset, calls: int = 2000, rounds: int = 7) -> float:
    """The best of ``rounds`` rounds of ``calls`` calls, each round from the inputs as ``reset``
    leaves them (the kernels that write in place, rotated again and again, would otherwise run
    on drifting values, which slows bf16's rotary past the first library's turn)."""
    best = float("inf")
    for _ in range(rounds):
        reset()
        start = time.perf_counter_ns()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


def calls(dtype: torch.dtype, suffix: str, rows: int) -> tuple[dict, object]:
    """Each kernel's call on the default model's shapes over ``rows`` rows, given a library, and
    the reset of the inputs they write in place."""
    x, residual = (torch.randn(rows, 576).to(dtype) for _ in range(2))
    weight = torch.rand(576).to(dtype)
    qkv, angles = torch.randn(rows, 960).to(dtype), torch.rand(rows, 32)
    cos, sin = angles.cos().repeat(1, 2).to(dtype), torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    wide, gate_up = torch.randn(rows, 1536).to(dtype), torch.randn(rows, 3072).to(dtype)
    xq, scale, flags = (
        torch.empty(rows, 1536, dtype=torch.int8),
        torch.empty(rows),
        torch.empty(1536, dtype=torch.uint8),
    )
    acc = torch.randint(-1000, 1000, (rows, 1536), dtype=torch.int32)
    row_scale, col_scale, out = torch.rand(rows), torch.rand(1536), torch.empty(rows, 1536, dtype=dtype)
    written = [(t, t.clone()) for t in (x, residual, qkv)]

    def reset():
        for tensor, start in written:
            tensor.copy_(start)

    p = torch.Tensor.data_ptr
    kernels = {
        "add_rms_norm 576": lambda lib: (
            lambda: getattr(lib, f"add_rms_norm_{suffix}")(p(x), p(residual), p(weight), rows, 576, 1e-5)
        ),
        "rotary 12 heads x 64": lambda lib: (
            lambda: getattr(lib, f"rotary_{suffix}")(p(qkv), rows, 960, 12, 64, p(cos), p(sin))
        ),
        "silu_and_mul 1536": lambda lib: (
            lambda: getattr(lib, f"silu_and_mul_{suffix}")(p(gate_up), rows, 3072, 1536, p(out))
        ),
        "quantize_rows_int8 1536": lambda lib: (
            lambda: getattr(lib, f"quantize_rows_int8_{suffix}")(
                p(wide), rows, 1536, 6.0, p(xq), p(scale), p(flags)
            )
        ),
        "rescale_int32 1536": lambda lib: (
            lambda: getattr(lib, f"rescale_int32_{suffix}")(
                p(acc), rows, 1536, p(row_scale), p(col_scale), p(out)
            )
        ),
    }
    return kernels, reset


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("old", type=Path)
    here = Path(__file__).resolve().parents[1] / "plugins/platforms/cpu-native/engine_platforms_cpu_native"
    parser.add_argument("new", type=Path, nargs="?", default=here)
    parser.add_argument(
        "--rows", type=int, default=32, help="rows a call (32: per-row arithmetic; 1: a token's calls)"
    )
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads (torch's pool)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    libraries = {"old": load_source(args.old / "kernels.c"), "new": load_source(args.new / "kernels.c")}
    for dtype, suffix in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
        kernels, reset = calls(dtype, suffix, args.rows)
        for name, make in kernels.items():
            ns = {
                key: min(best_ns(make(lib), reset) for _ in range(2)) / args.rows
                for key, lib in libraries.items()
            }
            print(
                f"{suffix:4s} {name:24s} per row: old {ns['old']:7.0f} ns  new {ns['new']:7.0f} ns"
                f"  old/new {ns['old'] / ns['new']:.2f}x"
            )


if __name__ == "__main__":
    main()
