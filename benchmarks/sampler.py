"""The sampler at decode batch sizes: the engine's against a full-vocabulary sort and an
exponential race (what it did before, and what vLLM's CPU sampler does), side by side.

    python benchmarks/sampler.py [--batches 1 16 64 256] [--vocab 49152] [--repeats 9] [--threads N]

For each batch and setting (temperature 1; top-p 0.9; top-k 50; top-k 50 + top-p 0.95; greedy)
the two samplers alternate on the same random logits; the medians and their ratio are printed.
``vllm bench serve`` sends no temperature, so every request of an online benchmark samples at
temperature 1: this is on every step's path there.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.messages.request import Request
from engine.messages.sampling_params import SamplingParams
from engine.runner import sampler

SETTINGS = {
    "temperature 1": dict(temperature=1.0),
    "top-p 0.9": dict(temperature=0.8, top_p=0.9),
    "top-k 50": dict(temperature=0.8, top_k=50),
    "top-k 50 + top-p 0.95": dict(top_k=50, top_p=0.95),
    "greedy": dict(temperature=0),
}


def sort_and_race(logits: torch.Tensor, rows: sampler.SamplingRows) -> torch.Tensor:
    """Baseline: sort the whole vocabulary for top-k/top-p, softmax, divide by exponential noise, argmax."""
    if rows.all_greedy:
        return logits.argmax(dim=-1)
    logits = logits / rows.temperature
    vocab = logits.shape[1]
    if any(0 < k < vocab for k in rows.top_k) or bool((rows.top_p < 1).any()):
        values, order = logits.sort(dim=-1)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in rows.top_k])
        values = values.masked_fill(values < values.gather(1, (vocab - ks).unsqueeze(1)), float("-inf"))
        drop = values.softmax(dim=-1).cumsum(dim=-1) <= 1 - rows.top_p
        drop[:, -1] = False
        logits = torch.empty_like(logits).scatter_(1, order, values.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default: SmolLM2's)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"vocab {args.vocab}, {torch.get_num_threads()} threads, median of {args.repeats}, ms per step")
    print(f"{'batch':>5}  {'setting':<22} {'sort+race':>10} {'engine':>8} {'ratio':>6}")
    for batch in args.batches:
        logits = torch.randn(batch, args.vocab) * 3
        for name, setting in SETTINGS.items():
            rows = sampler.SamplingRows(
                [Request(str(i), [1], SamplingParams(**setting)) for i in range(batch)], torch.device("cpu")
            )
            times = {"baseline": [], "engine": []}
            for _ in range(args.repeats):
                for key, run in (
                    ("baseline", sort_and_race),
                    ("engine", lambda x, r: sampler.sample(x, r)[0]),
                ):
                    start = time.perf_counter()
                    run(logits, rows)
                    times[key].append(time.perf_counter() - start)
            base, new = (statistics.median(times[k]) * 1e3 for k in ("baseline", "engine"))
            print(f"{batch:>5}  {name:<22} {base:>10.2f} {new:>8.2f} {base / new:>5.1f}x")


if __name__ == "__main__":
    main()
