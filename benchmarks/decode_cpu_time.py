"""A decode step's CPU time on one thread, at batch 1 and 16, on the default config: a figure that
other processes holding the cores move far less than wall time (on a shared machine), for comparing
two trees run one after the other.

    ENGINE_NUM_THREADS=1 python benchmarks/decode_cpu_time.py [--steps 40 10]

Prints ``RESULT b1 <ms> b16 <ms>``: the median thread CPU time of a step, after the prompts
prefill and 3 steps warm up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def step_cpu_ms(llm, prompts, steps: int) -> float:
    from offline_throughput import prefill_all

    from engine import SamplingParams
    from engine.messages.request import Request

    engine = llm.engine
    ids = [f"cpu-{len(prompts)}-{i}" for i in range(len(prompts))]
    params = SamplingParams(max_tokens=1024, temperature=0, ignore_eos=True)
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(Request(request_id, prompt, params))
    prefill_all(engine, len(prompts))
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.thread_time()
        engine.step()
        times.append(time.thread_time() - start)
    engine.abort(ids)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, nargs=2, default=[40, 10], help="steps at batch 1 and at 16")
    args = parser.parse_args()

    import torch
    from offline_throughput import make_prompts

    from engine import LLM

    llm = LLM()
    if torch.get_num_threads() != 1:
        sys.exit("run with ENGINE_NUM_THREADS=1: thread CPU time counts one thread")
    prompts = make_prompts(llm.tokenizer, 16)
    b1, b16 = step_cpu_ms(llm, prompts[:1], args.steps[0]), step_cpu_ms(llm, prompts, args.steps[1])
    print(f"RESULT b1 {b1:.2f} ms b16 {b16:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
