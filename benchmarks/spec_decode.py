"""Speculative decoding on the embedded default model: single-stream decode speed and
acceptance per method against no speculation, on a copy-heavy workload and on open-ended
chat, measured in one run.

    python benchmarks/spec_decode.py [--max-tokens 128] [--dtype bfloat16] [--eagle PATH]

Every run generates exactly --max-tokens tokens greedily (EOS ignored). `eagle` needs a
trained head checkpoint (--eagle); without one it is skipped (a random head proposes
nothing useful and only measures overhead — the tests cover its exactness).
"""

from __future__ import annotations

import argparse
import time

CODE = '''def compute_sum(values):
    """Add up a list of numbers, skipping None entries."""
    total = 0
    for value in values:
        if value is None:
            continue
        total += value
    return total


def compute_mean(values):
    """Average of the numbers in a list, skipping None entries."""
    present = [value for value in values if value is not None]
    if not present:
        return 0.0
    return compute_sum(present) / len(present)
'''
WORKLOADS = {
    "copy-heavy": f"Here is some Python code:\n\n{CODE}\nRepeat the code exactly, but rename compute_sum "
    "to add_all everywhere.",
    "open-ended chat": "Write a short story about a lighthouse keeper who befriends a seagull.",
}
METHODS = {
    "none": None,
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    "ngram k=8": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4},
    "suffix k=8": {"method": "suffix", "num_speculative_tokens": 8},
    "self-draft 29/30 layers k=2": {
        "method": "draft_model",
        "self_draft_layers": 29,
        "num_speculative_tokens": 2,
    },
}


def run(speculative_config, prompts, max_tokens, dtype):
    from engine import LLM, SamplingParams

    llm = LLM(dtype=dtype, speculative_config=speculative_config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    results = {}
    for name, messages in prompts.items():
        ids = llm.apply_chat_template(messages)
        llm.generate([ids], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        before = llm.engine.stats()
        start = time.perf_counter()
        llm.generate([ids], params)
        elapsed = time.perf_counter() - start
        after = llm.engine.stats()
        proposed = after.get("spec_draft_tokens", 0) - before.get("spec_draft_tokens", 0)
        accepted = after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
        results[name] = (max_tokens / elapsed, accepted / proposed if proposed else None)
    return results


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--eagle", default=None, help="an EAGLE head checkpoint folder for the default model")
    args = parser.parse_args()
    methods = dict(METHODS)
    if args.eagle:
        methods["eagle k=4"] = {"method": "eagle", "model": args.eagle, "num_speculative_tokens": 4}
    prompts = {name: [{"role": "user", "content": text}] for name, text in WORKLOADS.items()}
    table = {name: run(config, prompts, args.max_tokens, args.dtype) for name, config in methods.items()}
    base = table["none"]
    print(f"single-stream greedy decode, {args.max_tokens} tokens, {args.dtype}")
    print(f"{'method':<30}" + "".join(f"{w + ' tok/s':>24}{'speed-up':>10}{'accept':>8}" for w in WORKLOADS))
    for name, results in table.items():
        cells = ""
        for workload in WORKLOADS:
            tps, acceptance = results[workload]
            rate = "-" if acceptance is None else f"{acceptance:.0%}"
            cells += f"{tps:>24.1f}{tps / base[workload][0]:>9.2f}x{rate:>8}"
        print(f"{name:<30}{cells}")


if __name__ == "__main__":
    main()
