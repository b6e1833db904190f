"""The cpu-native layer kernels of two source trees side by side, per row: the (residual add +)
RMSNorm, the rotary, W8A8's row quantization and its int32 rescale, in bf16 and float32.

    python benchmarks/layer_kernels.py OLD_KERNELS_DIR [NEW_KERNELS_DIR]

Each directory holds a ``kernels.c`` (the plugin's ``engine_platforms_cpu_native`` folder of
another checkout; NEW defaults to this tree's). Both are built and loaded into one process and
called through ctypes on the same tensors, 32 rows a call (no call splits over threads), one
thread, old and new interleaved, the best of 7 × 2000 calls each, twice.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from engine.native import load_source

ROWS = 32


def best_ns(call, calls: int = 2000, rounds: int = 7) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


def calls(dtype: torch.dtype, suffix: str) -> dict:
    """Each kernel's call on the default model's shapes, given a library."""
    x, residual = (torch.randn(ROWS, 576).to(dtype) for _ in range(2))
    weight = torch.rand(576).to(dtype)
    qkv, angles = torch.randn(ROWS, 960).to(dtype), torch.rand(ROWS, 32)
    cos, sin = angles.cos().repeat(1, 2).to(dtype), torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    wide = torch.randn(ROWS, 1536).to(dtype)
    xq, scale, flags = (
        torch.empty(ROWS, 1536, dtype=torch.int8),
        torch.empty(ROWS),
        torch.empty(1536, dtype=torch.uint8),
    )
    acc = torch.randint(-1000, 1000, (ROWS, 1536), dtype=torch.int32)
    row_scale, col_scale, out = torch.rand(ROWS), torch.rand(1536), torch.empty(ROWS, 1536, dtype=dtype)
    p = torch.Tensor.data_ptr
    return {
        "add_rms_norm 576": lambda lib: (
            lambda: getattr(lib, f"add_rms_norm_{suffix}")(p(x), p(residual), p(weight), ROWS, 576, 1e-5)
        ),
        "rotary 12 heads x 64": lambda lib: (
            lambda: getattr(lib, f"rotary_{suffix}")(p(qkv), ROWS, 960, 12, 64, p(cos), p(sin))
        ),
        "quantize_rows_int8 1536": lambda lib: (
            lambda: getattr(lib, f"quantize_rows_int8_{suffix}")(
                p(wide), ROWS, 1536, 6.0, p(xq), p(scale), p(flags)
            )
        ),
        "rescale_int32 1536": lambda lib: (
            lambda: getattr(lib, f"rescale_int32_{suffix}")(
                p(acc), ROWS, 1536, p(row_scale), p(col_scale), p(out)
            )
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("old", type=Path)
    here = Path(__file__).resolve().parents[1] / "plugins/platforms/cpu-native/engine_platforms_cpu_native"
    parser.add_argument("new", type=Path, nargs="?", default=here)
    args = parser.parse_args()
    torch.set_num_threads(1)
    libraries = {"old": load_source(args.old / "kernels.c"), "new": load_source(args.new / "kernels.c")}
    for dtype, suffix in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
        for name, make in calls(dtype, suffix).items():
            ns = {key: min(best_ns(make(lib)) for _ in range(2)) / ROWS for key, lib in libraries.items()}
            print(
                f"{suffix:4s} {name:24s} per row: old {ns['old']:7.0f} ns  new {ns['new']:7.0f} ns"
                f"  old/new {ns['old'] / ns['new']:.2f}x"
            )


if __name__ == "__main__":
    main()
