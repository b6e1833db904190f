"""Qwen3's per-head q/k RMSNorm + rotary (``LayerOps.qk_norm_rotary``) side by side: the
plain torch ops against the cpu-native C kernel, on Qwen3-0.6B's heads (16 q and 8 kv heads
of 128), at 1 and 8 rows, bfloat16 and float32.

    python benchmarks/qk_norm_rotary.py [--repeats 7] [--calls 300] [--threads 1]

Both paths run interleaved (A B A B …) on copies of the same rows; each figure is the
median over ``--repeats`` rounds of ``--calls`` calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.layers import LayerOps, RMSNorm, RotaryEmbedding
from engine_platforms_cpu_native.platform import _native_ops

HEADS, KV_HEADS, HEAD_DIM, MAX_POSITIONS = 16, 8, 128, 4096


def _norm(dtype) -> RMSNorm:
    norm = RMSNorm(HEAD_DIM, 1e-6, dtype)
    norm.weight.data = torch.rand(HEAD_DIM).to(dtype) + 0.5
    norm.process_weights_after_loading()
    return norm


def per_call_us(ops, rows, norms, cos_sin, calls: int) -> float:
    inputs = [rows.clone() for _ in range(calls)]  # each call consumes its rows
    start = time.perf_counter()
    for qkv in inputs:
        ops.qk_norm_rotary(qkv, *norms, HEADS, KV_HEADS, HEAD_DIM, cos_sin)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    from transformers import Qwen3Config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = Qwen3Config(
        hidden_size=1024,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
    )
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in (1, 8):
            cos_sin = RotaryEmbedding(config, MAX_POSITIONS, dtype)(
                torch.randint(0, MAX_POSITIONS, (tokens,))
            )
            norms, rows = (
                (_norm(dtype), _norm(dtype)),
                torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype),
            )
            paths = {"torch": LayerOps(), "cpu-native": _native_ops(dtype)}
            times = {name: [] for name in paths}
            for _ in range(args.repeats):
                for name, ops in paths.items():
                    times[name].append(per_call_us(ops, rows, norms, cos_sin, args.calls))
            plain, native = (statistics.median(times[name]) for name in paths)
            print(
                f"{str(dtype).removeprefix('torch.'):8} rows={tokens}: torch {plain:6.1f} us  "
                f"cpu-native {native:6.1f} us  ratio {plain / native:.1f}x"
            )


if __name__ == "__main__":
    main()
