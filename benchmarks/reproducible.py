"""Reproducible greedy output, and what it costs: side by side in one run, on the embedded
default model.

    python benchmarks/reproducible.py [--configs default,batch-invariant,bf16,bf16-batch-invariant]
                                      [--num-prompts 32] [--output-len 64] [--repeats 3]
                                      [--answer-len 16] [--skip-agreement] [--skip-throughput]

Agreement: for each of the default and the ``--batch-invariant`` mode, one temperature-0
request run five ways — cold, again from the prefix cache (warm), with its prompt split
across 5-token prefill chunks (a fresh engine, no prefix cache), batched beside three other
requests, and cold in a fresh engine — and whether each way's tokens and log-probs are bit
for bit the first run's.

Throughput: every config generates ``--num-prompts`` prompts (16-255 tokens, mixed) ×
``--output-len`` tokens (EOS ignored) offline; the configs take turns, ``--repeats`` rounds,
so drift in the machine's speed reaches them all alike; each config's median tokens/s and
its ratio to bf16's are printed. Configs: ``default`` (the GGUF file kept quantized),
``batch-invariant`` (the same with ``--batch-invariant``), ``bf16`` (its weights in bf16,
``--quantization unquantized``), ``bf16-batch-invariant`` (that with ``--batch-invariant``:
the mode's fast path, whose target is 0.8× bf16).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from offline_throughput import make_prompts

CONFIGS = {
    "default": {},
    "batch-invariant": {"batch_invariant": True},
    "bf16": {"quantization": "unquantized"},
    "bf16-batch-invariant": {"quantization": "unquantized", "batch_invariant": True},
}
REQUEST = (
    "You are a careful assistant. Answer in full sentences. Name three colors of the rainbow, "
    "then explain in a few words why the sky looks blue on a clear afternoon."
)
OTHERS = ["Tell me a short story about a cat.", "What is the capital of France?", "1 2 3 4 5 6 7 8"]


def answer(llm, prompts: list[str], index: int, max_tokens: int):
    """(token ids, chosen-token log-probs) of ``prompts[index]``, generated beside the others."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    out = llm.generate(prompts, params, use_tqdm=False)[index].outputs[0]
    return out.token_ids, [next(iter(step.values())).logprob for step in out.logprobs]


def five_ways(options: dict, max_tokens: int) -> dict[str, tuple]:
    """The request's answer run five ways (the module docstring's list)."""
    from engine import LLM

    llm = LLM(**options)
    ways = {"cold": answer(llm, [REQUEST], 0, max_tokens)}
    ways["warm (prefix cache)"] = answer(llm, [REQUEST], 0, max_tokens)
    ways["batched"] = answer(llm, [OTHERS[0], REQUEST, *OTHERS[1:]], 1, max_tokens)
    chunked = LLM(max_num_batched_tokens=5, enable_prefix_caching=False, **options)
    ways["5-token chunks"] = answer(chunked, [REQUEST], 0, max_tokens)
    ways["cold, new engine"] = answer(LLM(**options), [REQUEST], 0, max_tokens)
    return ways


def print_agreement(max_tokens: int) -> None:
    for mode, options in {"default": {}, "--batch-invariant": {"batch_invariant": True}}.items():
        ways = five_ways(options, max_tokens)
        reference = ways["cold"]
        print(f"\n{mode}: the same request 5 ways, {max_tokens} tokens, against the first (cold)")
        for way, (tokens, logprobs) in ways.items():
            same_tokens, same_logprobs = tokens == reference[0], logprobs == reference[1]
            print(
                f"  {way:<20} tokens {'same' if same_tokens else 'DIFFER'}  "
                f"log-probs {'same' if same_logprobs else 'DIFFER'}"
            )


def throughput(llm, prompts, output_len: int) -> float:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def print_throughput(configs: list[str], num_prompts: int, output_len: int, repeats: int) -> None:
    from engine import LLM, SamplingParams

    engines = {name: LLM(**CONFIGS[name]) for name in configs}
    prompts = make_prompts(next(iter(engines.values())).get_tokenizer(), num_prompts)
    for llm in engines.values():  # warm-up: first-use costs (a bucket's probe, tapes) stay out
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for round_ in range(repeats):
        for name, llm in engines.items():
            rates[name].append(throughput(llm, prompts, output_len))
            print(f"  round {round_ + 1}: {name} {rates[name][-1]:.1f} tok/s", flush=True)
    print(f"\noffline, {num_prompts} prompts x {output_len} tokens, median of {repeats} rounds taken in turn")
    bf16 = statistics.median(rates["bf16"]) if "bf16" in rates else None
    for name, runs in rates.items():
        rate = statistics.median(runs)
        ratio = f"  {rate / bf16:.2f}x bf16" if bf16 else ""
        spread = f"(min {min(runs):.0f}, max {max(runs):.0f})"
        print(f"  {name:<22} {rate:8.1f} tok/s {spread}{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated throughput configs, of {', '.join(CONFIGS)} (default: all)",
    )
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts per throughput run (default 32)")
    parser.add_argument(
        "--output-len", type=int, default=64, help="tokens each prompt generates (default 64)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="throughput rounds, configs in turn (default 3)"
    )
    parser.add_argument(
        "--answer-len", type=int, default=16, help="tokens of the agreement request (default 16)"
    )
    parser.add_argument("--skip-agreement", action="store_true", help="measure throughput only")
    parser.add_argument("--skip-throughput", action="store_true", help="check agreement only")
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    if not args.skip_agreement:
        print_agreement(args.answer_len)
    if not args.skip_throughput:
        print_throughput(configs, args.num_prompts, args.output_len, args.repeats)


if __name__ == "__main__":
    main()
