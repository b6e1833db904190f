"""An fp8 KV cache (``--kv-cache-dtype fp8``) against the bf16 cache on the default model, side
by side in one run.

    python benchmarks/kv_fp8.py [--kv-cache-dtype fp8] [--windows 8] [--prompt-len 64]
                                [--length 64] [--batch 64] [--context 2048] [--steps 5]
                                [--repeats 15] [--threads N] [--skip-quality] [--skip-e2e]
    python benchmarks/kv_fp8.py --rounding TOKENS

Quality: the held text's windows (``engine.testing.divergence``) teacher-forced through
``LLM()`` with each cache — the share of positions whose most likely next token agrees and the
mean and largest absolute difference of the text's own token's log-prob — and free-running:
greedy tokens from each window's prompt, the share equal position by position and the mean
length before the first difference. Speed: one layer's cpu-native decode attention at
``--batch`` requests of ``--context`` tokens on the default model's shape, bf16 against fp8
pages, calls interleaved, with the requests' blocks shuffled over the pool and in order (as a
fresh engine allocates them: the pages a prefetcher follows); then one decode step of ``LLM()``
with each cache at that batch and context (every prompt prefilled first, with progress; steps
of the two engines interleaved, checked free of preemption), median of each. ``--rounding``:
only the relative RMS error of the default model's own keys and values on that many held
tokens, stored as e4m3, e5m2 and as int8 with a scale per token and head (what an int8 cache
would buy, ``docs/decisions.md``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import attrs
import torch
from attention import SPEC, decode_inputs, time_calls
from offline_throughput import prefill_all

from engine import LLM, SamplingParams
from engine.builtin.platforms import CpuPlatform
from engine.interfaces import KV_CACHE_DTYPES, BatchLayout, KVScale
from engine.layers.attention import Attention
from engine.messages.request import Request
from engine.plugins import load_plugins
from engine.testing import divergence


def teacher_forced(llm: LLM, sequences) -> tuple[list[int], torch.Tensor]:
    """Each position's most likely next token and the log-prob of the sequence's own."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    top, logprobs = [], []
    for seq, out in zip(sequences, outs):
        for token, entry in zip(seq[1:], out.prompt_logprobs[1:]):
            top.append(min(entry.items(), key=lambda item: item[1].rank)[0])
            logprobs.append(entry[token].logprob)
    return top, torch.tensor(logprobs)


def greedy(llm: LLM, prompts, length: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outs]


def quality(kv_dtype: str, windows: int, prompt_len: int, length: int) -> None:
    engines = {name: LLM(kv_cache_dtype=name) for name in ("auto", kv_dtype)}
    held = divergence.held_windows(engines["auto"].tokenizer, windows, prompt_len, length)
    sequences = [prompt + forced for prompt, forced in held]
    (base_top, base), (top, logprobs) = (teacher_forced(engines[n], sequences) for n in ("auto", kv_dtype))
    drift = (base - logprobs).abs()
    agree = sum(a == b for a, b in zip(base_top, top)) / len(top)
    print(f"teacher-forced, {windows} held windows of {prompt_len}+{length} tokens ({len(top)} positions):")
    print(f"  next-token agreement {agree:.3f}; |log-prob difference| mean {drift.mean():.4f}", end="")
    print(f", max {drift.max():.3f}")
    print(f"  mean log-prob of the text: bf16 cache {base.mean():.4f}, {kv_dtype} {logprobs.mean():.4f}")
    prompts = [prompt for prompt, _ in held]
    runs = [greedy(engines[n], prompts, length) for n in ("auto", kv_dtype)]
    same = sum(a == b for x, y in zip(*runs) for a, b in zip(x, y)) / sum(len(x) for x in runs[0])
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(*runs)]
    print(f"free-running, {length} greedy tokens from each window's prompt:")
    print(f"  tokens equal position by position {same:.3f}; first difference at {first}", end="")
    print(f" (mean {statistics.mean(first):.1f})")


def captured_kv(llm: LLM, prompt: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each attention layer's keys and values [tokens, kv heads, head_dim] for ``prompt``."""
    captured = []

    def keeping(forward):  # the engine's layers skip module hooks: the call is wrapped instead
        def wrapped(q, k, v, *args, **kwargs):
            captured.append((k.detach().float().clone(), v.detach().float().clone()))
            return forward(q, k, v, *args, **kwargs)

        return wrapped

    layers = [m for m in llm.engine.model.modules() if isinstance(m, Attention)]
    for layer in layers:
        layer.forward = keeping(layer.forward)
    try:
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        for layer in layers:
            del layer.forward
    head_dim = SPEC.head_dim  # the default model's, as the attention benchmark's spec says
    return [(k.reshape(k.shape[0], -1, head_dim), v.reshape(v.shape[0], -1, head_dim)) for k, v in captured]


def int8_per_head(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 with one absmax scale per (token, head): an int8 cache's best case."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return (x / scale).round().clamp(-127, 127) * scale


def rounding(tokens: int) -> None:
    """Relative RMS error of the default model's own keys and values stored per cache format."""
    llm = LLM()
    prompt = divergence.held_windows(llm.tokenizer, 1, tokens, 0)[0][0]
    formats = {
        "fp8 e4m3 (scale 1)": lambda x: x.to(torch.float8_e4m3fn).float(),
        "fp8 e5m2 (scale 1)": lambda x: x.to(torch.float8_e5m2).float(),
        "int8, a scale per token and head": int8_per_head,
    }
    print(f"relative RMS rounding error of K and V, {tokens} held tokens, mean over layers:")
    kv = captured_kv(llm, prompt)
    for name, store in formats.items():
        errors = [[((store(x) - x).norm() / x.norm()).item() for x in pair] for pair in kv]
        k_err, v_err = (statistics.mean(column) for column in zip(*errors))
        print(f"  {name}: K {k_err:.4f}, V {v_err:.4f}")


def clock():
    """On one thread (``--threads 1``) the thread's CPU time, which the other jobs of a loaded
    machine do not inflate as they do the wall time; else the wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def in_order(layout: BatchLayout) -> BatchLayout:
    """``layout`` with each request's blocks one after another in the pool, as the engine's
    allocator hands out a fresh pool: the hardware prefetcher then follows a request's pages,
    which it cannot through shuffled ones, and fewer bytes read matter less."""
    batch, per_request = layout.block_table.shape
    table = (torch.arange(batch * per_request, dtype=torch.int32) + 1).view(batch, per_request)
    last = layout.seq_lens_host[0] - 1
    slots = table[:, last // SPEC.block_size].long() * SPEC.block_size + last % SPEC.block_size
    return attrs.evolve(layout, block_table=table, slot_mapping=slots)


def attention(kv_dtype: str, batch: int, context: int, repeats: int) -> None:
    """One layer's cpu-native decode attention over bf16 and fp8 pages, interleaved, with the
    requests' blocks shuffled over the pool and in order."""
    registry, platform = load_plugins(), CpuPlatform()
    cls = registry.get("attention_backends", "cpu-native")
    specs = {"bf16": SPEC, kv_dtype: attrs.evolve(SPEC, kv_cache_dtype=KV_CACHE_DTYPES[kv_dtype])}
    gen = torch.Generator().manual_seed(0)
    shuffled, pool, (q, k, v) = decode_inputs(batch, context, gen)
    print(f"one layer's cpu-native decode attention, batch {batch} x context {context}", end="")
    print(f", median of {repeats} ({clock().__name__}):")
    for blocks, layout in (("shuffled", shuffled), ("in order", in_order(shuffled))):
        calls = {}
        for name, spec in specs.items():
            backend = cls(spec, platform, registry=registry)
            cache = torch.randn(backend.kv_cache_shape(pool), generator=gen).to(spec.cache_dtype)
            quantized = {"kv_scale": KVScale()} if spec.kv_cache_dtype is not None else {}
            calls[name] = functools.partial(
                backend.forward, q, k, v, cache, backend.build_metadata(layout), **quantized
            )
        medians = time_calls(calls, repeats, clock())
        base, new = medians["bf16"] * 1e6, medians[kv_dtype] * 1e6
        print(f"  blocks {blocks}: bf16 pages {base:.0f} µs, {kv_dtype} pages {new:.0f} µs", end="")
        print(f", bf16/{kv_dtype} {base / new:.2f}x")


def end_to_end(kv_dtype: str, batch: int, context: int, steps: int) -> None:
    """One decode step of ``LLM()`` with each cache at ``batch`` requests of ``context`` tokens."""
    max_tokens = steps * 4 + 64
    blocks = batch * -(-(context + max_tokens) // 16) + 2  # the same blocks for both: room for every token
    engines = {}
    for name in ("auto", kv_dtype):
        # whole-budget prefill chunks: no request decodes (and finishes) before all are prefilled
        engine = LLM(kv_cache_dtype=name, num_blocks=blocks, block_size=16, shared_step_target_s=0).engine
        for i in range(batch):
            prompt = [(7 * i + j) % 1000 + 10 for j in range(context)]
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            engine.add_request(Request(f"{name}-{i}", prompt, params))
        start = time.perf_counter()
        prefill_all(engine, batch, progress_s=30)
        print(f"{name} cache: {batch} x {context} tokens prefilled in {time.perf_counter() - start:.0f} s")
        engines[name] = engine
    medians = time_calls({name: engine.step for name, engine in engines.items()}, steps, clock())
    for name, engine in engines.items():
        requests = engine.lifecycle.requests.values()
        assert len(requests) == batch, f"{name}: a request finished while the steps were timed"
        assert not any(r.num_preemptions for r in requests), f"{name}: a request was preempted"
    base, new = medians["auto"] * 1e3, medians[kv_dtype] * 1e3
    print(f"LLM() decode step at batch {batch} x context {context}, median of {steps} ({clock().__name__}):")
    print(f"  bf16 cache {base:.1f} ms, {kv_dtype} cache {new:.1f} ms, bf16/{kv_dtype} {base / new:.2f}x")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="fp8",
        choices=[n for n in KV_CACHE_DTYPES if n != "auto"],
        help="the quantized cache compared with the bf16 one (default fp8, i.e. e4m3)",
    )
    parser.add_argument(
        "--windows", type=int, default=8, help="held-text windows for the quality figures (default 8)"
    )
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of a window (default 64)")
    parser.add_argument(
        "--length", type=int, default=64, help="tokens forced, or generated, after it (default 64)"
    )
    parser.add_argument(
        "--batch", type=int, default=64, help="decoding requests for the speed figures (default 64)"
    )
    parser.add_argument("--context", type=int, default=2048, help="their context in tokens (default 2048)")
    parser.add_argument("--steps", type=int, default=5, help="decode steps timed per engine (default 5)")
    parser.add_argument(
        "--repeats", type=int, default=15, help="attention calls timed per cache (default 15)"
    )
    parser.add_argument(
        "--threads", type=int, help="torch (and OpenMP) threads; default: torch's (1: timed in CPU time)"
    )
    parser.add_argument("--skip-quality", action="store_true", help="no quality figures")
    parser.add_argument(
        "--rounding",
        type=int,
        metavar="TOKENS",
        help="only the K/V rounding error of fp8 and a per-head int8 on this many held tokens",
    )
    parser.add_argument(
        "--skip-e2e", action="store_true", help="no LLM() decode step (the attention call only)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rounding:
        rounding(args.rounding)
        return
    if not args.skip_quality:
        quality(args.kv_cache_dtype, args.windows, args.prompt_len, args.length)
    attention(args.kv_cache_dtype, args.batch, args.context, args.repeats)
    if not args.skip_e2e:
        end_to_end(args.kv_cache_dtype, args.batch, args.context, args.steps)


if __name__ == "__main__":
    main()
