"""Paged decode attention: the torch backend against cpu-native, side by side in one run.

    python benchmarks/attention.py [--batches 1 16 64 256] [--contexts 128 256 512 1024]
                                   [--repeats 15] [--threads N] [--skip-e2e]

Micro-benchmark: one layer's attention call (this step's K/V written, then attended) on
the default model's shape (9 query heads, 3 KV heads, head_dim 64, block size 16, bf16),
every request decoding one token over the given context, blocks shuffled over the pool.
Calls alternate torch, cpu-native, torch, ... on the same inputs; the median of each is
printed with their ratio. End-to-end: one decode step of ``LLM()`` at batch 64 with each
backend (median of a few steps, steps of the two engines interleaved).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from offline_throughput import prefill_all

from engine.builtin.platforms import CpuPlatform
from engine.interfaces import AttentionSpec, BatchLayout
from engine.plugins import load_plugins

SPEC = AttentionSpec(num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, block_size=16)
BACKENDS = ("torch", "cpu-native")


def decode_inputs(batch: int, context: int, gen: torch.Generator):
    """A decode layout for ``batch`` requests at ``context`` tokens (the new one included),
    their blocks a random permutation of the pool, and the step's q, k, v."""
    bs = SPEC.block_size
    per_request = -(-context // bs)
    pool = batch * per_request + 1
    tables = (torch.randperm(pool - 1, generator=gen) + 1).view(batch, per_request).int()
    slots = tables[:, (context - 1) // bs].long() * bs + (context - 1) % bs
    layout = BatchLayout(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        block_table=tables,
        slot_mapping=slots,
        query_lens=(1,) * batch,
        seq_lens_host=(context,) * batch,
    )
    qkv = [
        torch.randn(batch, h, SPEC.head_dim, generator=gen).to(SPEC.dtype)
        for h in (SPEC.num_heads, SPEC.num_kv_heads, SPEC.num_kv_heads)
    ]
    return layout, pool, qkv


def time_calls(calls: dict, repeats: int, clock=time.perf_counter) -> dict[str, float]:
    """Median seconds of each call by ``clock``, run interleaved (A B A B ...) after one warm-up
    each."""
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = clock()
            call()
            times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def micro(batches, contexts, repeats: int) -> None:
    registry, platform = load_plugins(), CpuPlatform()
    backends = {name: registry.get("attention_backends", name)(SPEC, platform) for name in BACKENDS}
    gen = torch.Generator().manual_seed(0)
    print(f"one layer's decode attention, {SPEC}, {torch.get_num_threads()} threads, median of {repeats}")
    print(f"{'batch':>5} {'context':>7} {'torch µs':>10} {'cpu-native µs':>14} {'ratio':>6}")
    for batch in batches:
        for context in contexts:
            layout, pool, (q, k, v) = decode_inputs(batch, context, gen)
            calls = {}
            for name, backend in backends.items():
                cache = torch.randn(backend.kv_cache_shape(pool), generator=gen).to(SPEC.dtype)
                metadata = backend.build_metadata(layout)
                calls[name] = functools.partial(backend.forward, q, k, v, cache, metadata)
            medians = time_calls(calls, repeats)
            base, new = medians["torch"] * 1e6, medians["cpu-native"] * 1e6
            print(f"{batch:>5} {context:>7} {base:>10.0f} {new:>14.0f} {base / new:>5.2f}x")


def end_to_end(batch: int = 64, steps: int = 5) -> None:
    """One decode step of ``LLM()`` at ``batch`` requests with each backend, interleaved."""
    from engine import LLM, SamplingParams
    from engine.messages.request import Request

    engines = {}
    for name in BACKENDS:
        # whole-budget prefill chunks: no request decodes (and finishes) before all are prefilled
        engine = LLM(attention_backend=name, shared_step_target_s=0).engine
        for i in range(batch):
            prompt = [(7 * i + j) % 1000 + 10 for j in range(16 + (i * 37) % 240)]
            engine.add_request(
                Request(
                    f"{name}-{i}",
                    prompt,
                    SamplingParams(max_tokens=steps * 4 + 64, temperature=0, ignore_eos=True),
                )
            )
        prefill_all(engine, batch)
        engines[name] = engine
    medians = time_calls({name: engine.messages.step for name, engine in engines.items()}, steps)
    base, new = medians["torch"] * 1e3, medians["cpu-native"] * 1e3
    print(f"\nLLM() decode step at batch {batch} (contexts 16-255 prompt tokens), median of {steps}:")
    print(f"torch {base:.1f} ms, cpu-native {new:.1f} ms, ratio {base / new:.2f}x")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, help="torch (and OpenMP) threads; default: torch's")
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    micro(args.batches, args.contexts, args.repeats)
    if not args.skip_e2e:
        end_to_end()


if __name__ == "__main__":
    main()
