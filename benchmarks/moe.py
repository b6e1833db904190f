"""The MoE layer side by side: ``FusedMoE`` (tokens sorted by expert, one grouped matmul per
projection) against a naive loop over tokens (each token's top-k experts multiplied one by
one), and the grouped layer's fallback (a loop over the experts that received tokens), at
batch 1, 16 and 64.

    python benchmarks/moe.py [--batches 1 16 64] [--repeats 9] [--threads N] [--dtype bfloat16]

Two shapes: Mixtral-like (8 experts, top-2, wide experts) and Qwen3-MoE-like (64 experts,
top-8, narrow experts), both scaled to hidden 1024. The same inputs and router logits go to
every path, interleaved (A B C A B C ...); each figure is the median over ``--repeats``
rounds, and the outputs are checked against each other.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F

from engine.interfaces import QuantContext
from engine.layers import moe
from engine.layers.moe import select_experts
from engine.layers.unquantized import UnquantizedLinearMethod
from engine.testing.moe import loaded_moe

SHAPES = {
    "mixtral-like": dict(num_experts=8, top_k=2, hidden=1024, intermediate=3584),
    "qwen3-moe-like": dict(num_experts=64, top_k=8, hidden=1024, intermediate=512),
}


def per_token_loop(layer, x, router_logits):
    """The naive path: every (token, chosen expert) pair multiplied on its own."""
    weights, ids = select_experts(router_logits, layer.top_k, layer.renormalize)
    gate_up, down = layer.gate_up.weight, layer.down.weight
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for choice in range(layer.top_k):
            expert = int(ids[token, choice])
            gate, up = F.linear(x[token : token + 1], gate_up[expert]).chunk(2, dim=-1)
            row = F.linear(F.silu(gate) * up, down[expert])
            out[token] += (row[0] * weights[token, choice]).to(x.dtype)
    return out


def expert_loop(layer, x, router_logits):
    """FusedMoE with torch._grouped_mm unavailable: the loop over experts that have rows."""
    with mock.patch.object(moe, "_grouped_mm_takes", lambda *args: False):
        return layer(x, router_logits)


def timed(fn, *args, min_seconds=0.05) -> float:
    """Seconds per call, calls repeated until ``min_seconds`` pass."""
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or calls < 2:
        fn(*args)
        calls += 1
    return elapsed / calls


@torch.inference_mode()
def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    method = UnquantizedLinearMethod(QuantContext(None, dtype, None))
    print(
        f"threads {torch.get_num_threads()}, {args.dtype}; ms per layer call, median of {args.repeats}; "
        "ratios: naive time / grouped time"
    )
    print(
        f"{'shape':>15} {'batch':>5} {'per-token':>10} {'per-expert':>11} {'grouped':>9} "
        f"{'naive/grouped':>14} {'per-expert/grouped':>19} {'max |Δ|':>8}"
    )
    for name in args.shapes:
        shape = SHAPES[name]
        layer, _, _ = loaded_moe(
            method,
            shape["num_experts"],
            shape["top_k"],
            shape["hidden"],
            shape["intermediate"],
            renormalize=True,
        )
        gen = torch.Generator().manual_seed(1)
        for batch in args.batches:
            x = torch.randn(batch, shape["hidden"], generator=gen).to(dtype)
            logits = torch.randn(batch, shape["num_experts"], generator=gen)
            paths = {
                "per-token": per_token_loop,
                "per-expert": expert_loop,
                "grouped": lambda lay, *a: lay(*a),
            }
            outs = {key: fn(layer, x, logits).float() for key, fn in paths.items()}
            diff = max((outs[key] - outs["grouped"]).abs().max().item() for key in outs)
            times = {key: [] for key in paths}
            for _ in range(args.repeats):
                for key, fn in paths.items():
                    times[key].append(timed(fn, layer, x, logits))
            med = {key: statistics.median(t) * 1e3 for key, t in times.items()}
            print(
                f"{name:>15} {batch:>5} {med['per-token']:>10.2f} {med['per-expert']:>11.2f} "
                f"{med['grouped']:>9.2f} {med['per-token'] / med['grouped']:>13.2f}× "
                f"{med['per-expert'] / med['grouped']:>18.2f}× {diff:>8.1e}"
            )


if __name__ == "__main__":
    main()
