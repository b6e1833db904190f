"""Offline throughput: the same prompts through this engine and through `transformers`
generate, side by side in one run, on the embedded default model.

    python benchmarks/offline_throughput.py [--num-prompts 64] [--output-len 128] [--dtype bfloat16]
                                            [--skip-hf] [--profile]

Prompts have mixed lengths (deterministic), every request generates exactly
--output-len tokens (EOS ignored). `transformers` runs one batch with left padding, its
best case for throughput. --profile adds a torch profile of one decode step at the same
batch size, to show where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import time

importlib.import_module("engine")  # before torch: the engine sets OpenMP's wait policy before libgomp loads
import torch


def make_prompts(tokenizer, num: int) -> list[list[int]]:
    words = [
        "the",
        "engine",
        "schedules",
        "requests",
        "in",
        "blocks",
        "while",
        "the",
        "model",
        "reads",
        "its",
        "cache",
        "and",
        "samples",
        "tokens",
        "for",
        "every",
        "sequence",
        "in",
        "the",
        "batch",
    ]
    prompts = []
    for i in range(num):
        length = 16 + (i * 37) % 240  # 16..255 tokens
        text = " ".join(words[(i + j) % len(words)] for j in range(length))
        prompts.append(tokenizer.encode(text)[:length])
    return prompts


def run_engine(llm, prompts, output_len):
    from engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, elapsed


@torch.inference_mode()
def run_hf(model, prompts, output_len, pad_id):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        pad_token_id=pad_id,
    )
    elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * len(prompts) / elapsed, elapsed


def decoding(engine) -> list:
    """The engine's requests that are running past their prompt."""
    from engine.messages.request import RequestStatus

    return [
        r
        for r in engine.lifecycle.requests.values()
        if r.status is RequestStatus.RUNNING and r.num_computed_tokens >= r.num_prompt_tokens
    ]


def prefill_all(engine, count: int, progress_s: float | None = None) -> None:
    """Step until all ``count`` requests added to ``engine`` have prefilled and decode (an
    AssertionError if one finishes first: the step loop would otherwise wait for it forever).
    With ``progress_s``, print the prompt tokens computed so far at most that often."""
    start = last = time.perf_counter()
    while len(decoding(engine)) < count:
        assert len(engine.lifecycle.requests) == count, "a request finished before all were prefilled"
        engine.step()
        if progress_s is not None and time.perf_counter() - last >= progress_s:
            last = time.perf_counter()
            print(f"  prefill: {prefilled_tokens(engine)} tokens in {last - start:.0f} s", flush=True)


def prefilled_tokens(engine) -> int:
    """Prompt tokens the engine's requests have computed."""
    requests = engine.lifecycle.requests.values()
    return sum(min(r.num_computed_tokens, r.num_prompt_tokens) for r in requests)


def decode_steps(llm, prompts, steps: int, profiler=None) -> list[float]:
    """Seconds of each of ``steps`` decode steps with every prompt in the batch: the prompts are
    prefilled first, two steps warm up, ``profiler`` (a context manager) wraps the timed ones."""
    from engine import SamplingParams
    from engine.messages.request import Request

    engine = llm.engine
    ids = [f"steps-{i}" for i in range(len(prompts))]
    # room for the steps that decode while later prompts prefill: every request must still be running
    params = SamplingParams(max_tokens=1024, temperature=0, ignore_eos=True)
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(Request(request_id, prompt, params))
    prefill_all(engine, len(prompts))
    engine.step()
    engine.step()
    assert len(decoding(engine)) == len(prompts), "a request finished or was preempted"
    times = []
    with profiler or contextlib.nullcontext():
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    engine.abort(ids)
    return times


def profile_decode_step(llm, prompts):
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    (elapsed,) = decode_steps(llm, prompts, 1, prof)
    print(f"\none decode step at batch {len(prompts)}: {elapsed * 1000:.1f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    from engine import LLM
    from engine.testing.reference import hf_from_loader
    from engine_quant_gguf.loader import GGUFLoader, default_model_path

    llm = LLM(dtype=args.dtype)
    prompts = make_prompts(llm.tokenizer, args.num_prompts)
    print(
        f"{len(prompts)} prompts, {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"{args.output_len} output tokens each, {args.dtype}, {torch.get_num_threads()} threads"
    )
    engine_tps, engine_s = run_engine(llm, prompts, args.output_len)
    print(f"engine:       {engine_tps:8.1f} output tok/s  ({engine_s:.1f} s)")
    single_tps, _ = run_engine(llm, prompts[:1], args.output_len)
    print(f"engine single-stream: {single_tps:8.1f} tok/s")
    if not args.skip_hf:
        model = hf_from_loader(GGUFLoader(default_model_path()), getattr(torch, args.dtype))
        hf_tps, hf_s = run_hf(model, prompts, args.output_len, pad_id=llm.tokenizer.pad_token_id or 0)
        print(f"transformers: {hf_tps:8.1f} output tok/s  ({hf_s:.1f} s)")
        hf_single, _ = run_hf(model, prompts[:1], args.output_len, pad_id=llm.tokenizer.pad_token_id or 0)
        print(f"transformers single-stream: {hf_single:8.1f} tok/s")
        print(
            f"ratio engine/transformers: batched {engine_tps / hf_tps:.2f}x, single-stream "
            f"{single_tps / hf_single:.2f}x"
        )
    if args.profile:
        profile_decode_step(llm, prompts)


if __name__ == "__main__":
    main()
