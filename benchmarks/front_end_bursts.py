"""What a front end's CPU burst after each step costs a decode step: the default config's
decode steps at one batch size, with and without a second process that busy-loops for
``--burst-ms`` on one core each time a step ends (what an API server and its client do with a
step's tokens: one SSE frame a stream), alternated in one engine.

    python benchmarks/front_end_bursts.py [--batch 64] [--burst-ms 10] [--steps 20] [--rounds 3]

Prints each round's median step with and without the burst. With the kernel team on every core,
a burst that took half the team's threads for its length would cost half of it; on two cores it
cost more (docs/decisions.md, "Online on two cores").
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

# the second process: for each line "<ms>" on stdin, busy-loops that long
BURNER = """
import sys, time
for line in sys.stdin:
    end = time.perf_counter() + float(line) / 1e3
    while time.perf_counter() < end:
        pass
"""


def median_step_ms(engine, steps: int, burner: subprocess.Popen | None, burst_ms: float) -> float:
    times = []
    for _ in range(steps):
        if burner is not None:
            burner.stdin.write(f"{burst_ms}\n")
            burner.stdin.flush()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64, help="requests decoding together (default 64)")
    parser.add_argument(
        "--burst-ms", type=float, default=10.0, help="the second process's burst a step (default 10)"
    )
    parser.add_argument(
        "--steps", type=int, default=20, help="decode steps timed each way a round (default 20)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of quiet, then burst (default 3)")
    args = parser.parse_args()

    from offline_throughput import make_prompts, prefill_all

    from engine import LLM, SamplingParams
    from engine.messages.request import Request

    burner = subprocess.Popen([sys.executable, "-c", BURNER], stdin=subprocess.PIPE, text=True)
    try:
        llm = LLM()
        engine = llm.engine
        prompts = make_prompts(llm.tokenizer, args.batch)
        # room for every step of every round: the requests must all still be running
        tokens = 8 + 2 * args.rounds * args.steps
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(Request(f"bursts-{i}", prompt, params))
        prefill_all(engine, args.batch)
        engine.step()
        print(f"default config, batch {args.batch}, median of {args.steps} decode steps (ms):", flush=True)
        for round_ in range(args.rounds):
            quiet = median_step_ms(engine, args.steps, None, 0)
            bursts = median_step_ms(engine, args.steps, burner, args.burst_ms)
            print(
                f"  round {round_ + 1}: quiet {quiet:.1f}, with a {args.burst_ms:g} ms burst {bursts:.1f}"
                f" (+{bursts - quiet:.1f}; half the burst would be +{args.burst_ms / 2:g})",
                flush=True,
            )
    finally:
        burner.stdin.close()
        burner.wait()


if __name__ == "__main__":
    main()
