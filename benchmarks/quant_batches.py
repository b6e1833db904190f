"""The default config (GGUF kept quantized) and W8A8 against bf16 (the same file dequantized)
at several batch sizes, side by side in one run, on the embedded default model: decode-step
time and offline throughput.

    python benchmarks/quant_batches.py [--batches 1 16 64 256] [--output-len 32] [--repeats 2]
                                       [--configs default int8-w8a8] [--threads N]

For each batch size B every engine generates for the same B prompts (16–255 tokens, EOS
ignored), alternating (bf16, default, int8-w8a8, bf16, …). Decode-step time is the median of 8
engine steps timed one by one with all B requests decoding (after their prefill; prefix caching
off); throughput is B × output-len over a whole run. Each figure is the best of ``--repeats``
(this shared machine's run-to-run spread is ±10 %). ``--threads`` sets the engine's thread
count (torch's and the kernels' OpenMP pool, ``ENGINE_NUM_THREADS``): on a machine busier than
its cores, threads that wait at barriers for preempted peers make every figure several times
slower, one thread keeps the comparison fair.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from offline_throughput import decode_steps, make_prompts

CONFIGS = {
    "bf16": dict(quantization="unquantized"),
    "default": dict(),
    "int8-w8a8": dict(quantization="int8-w8a8"),
}
COMMON = dict(enable_prefix_caching=False)  # the runs repeat the same prompts: each must prefill them


def timed_run(llm, prompts, tokens) -> float:
    from engine import SamplingParams

    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["default", "int8-w8a8"], choices=list(CONFIGS)[1:])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        os.environ["ENGINE_NUM_THREADS"] = str(args.threads)  # the CPU platform sets torch's threads
    from engine import LLM

    names = ["bf16", *args.configs]
    engines = {name: LLM(**COMMON, **CONFIGS[name]) for name in names}
    prompts = make_prompts(engines["bf16"].tokenizer, max(args.batches))
    for llm in engines.values():
        timed_run(llm, prompts[:2], 4)  # warm-up
    print("decode-step ms and offline tok/s per engine; ratio: bf16 time / engine time")
    print(f"{'batch':>5} " + " ".join(f"| {name:>10} {'ms':>7} {'tok/s':>7} {'ratio':>6}" for name in names))
    for batch in args.batches:
        step, throughput = {}, {}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                median_step = statistics.median(decode_steps(llm, prompts[:batch], 8))
                step[name] = min(step.get(name, float("inf")), median_step)
                whole = timed_run(llm, prompts[:batch], args.output_len)
                throughput[name] = max(throughput.get(name, 0.0), batch * args.output_len / whole)
        print(
            f"{batch:>5} "
            + " ".join(
                f"| {'':>10} {step[n] * 1e3:>7.1f} {throughput[n]:>7.0f} {step['bf16'] / step[n]:>5.2f}×"
                for n in names
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
