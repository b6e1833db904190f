"""Greedy decode at several ``num_scheduler_steps`` in one process: the same engine, its setting
changed between runs, the order rotating round by round, so that a shared machine's bandwidth
moves every setting alike.

    python benchmarks/decode_bursts.py [--model PATH] [--steps 1 4] [--prompts 1] [--tokens 128]
                                       [--rounds 10]

Each round generates ``--prompts`` prompts of ``--tokens`` greedy tokens (EOS ignored) once per
setting. With ``num_scheduler_steps`` N a scheduling pass may replay the greedy decode step's
recording N times, each step's tokens fed to the next, so the step's host work (scheduling,
flattening, applying, detokenizing) is paid once per N tokens. Prints each setting's ms per
token (wall time; thread CPU time with ``ENGINE_NUM_THREADS=1``) round by round, each setting's
per-round ratio to the first one's and their median, and whether all gave the same tokens.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time

importlib.import_module("engine")  # before torch: the engine sets OpenMP's wait policy before libgomp loads

import attrs

from engine import LLM, SamplingParams

PROMPT = "The history of the city begins with"


def with_steps(config, steps: int):
    return attrs.evolve(config, scheduler=attrs.evolve(config.scheduler, num_scheduler_steps=steps))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="a GGUF file or model folder (default: the default model)"
    )
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 4], help="num_scheduler_steps settings")
    parser.add_argument("--prompts", type=int, default=1, help="prompts decoded side by side")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each prompt generates")
    parser.add_argument("--rounds", type=int, default=10, help="rounds, each running every setting once")
    args = parser.parse_args()

    llm = LLM(args.model, dtype="bfloat16", max_model_len=2048)
    engine = llm.engine
    configs = {steps: with_steps(engine.config, steps) for steps in args.steps}
    clock = time.thread_time if os.environ.get("ENGINE_NUM_THREADS") == "1" else time.perf_counter
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    prompts = [PROMPT] if args.prompts == 1 else [f"{PROMPT} number {i}" for i in range(args.prompts)]
    llm.generate(prompts, params, use_tqdm=False)

    times: dict[int, list[float]] = {steps: [] for steps in args.steps}
    tokens: dict[int, list] = {}
    for round_ in range(args.rounds):
        shift = round_ % len(args.steps)
        for steps in args.steps[shift:] + args.steps[:shift]:
            engine.config = configs[steps]
            start = clock()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            times[steps].append((clock() - start) / args.tokens * 1e3)
            tokens[steps] = [o.outputs[0].token_ids for o in outputs]

    kind = "thread CPU" if clock is time.thread_time else "wall"
    print(f"{args.prompts} prompt(s), {kind} ms per token (per step of all prompts), round by round")
    first = args.steps[0]
    for steps, figures in times.items():
        print(
            f"  steps {steps:2d}  median {statistics.median(figures):7.3f}:",
            " ".join(f"{t:.3f}" for t in figures),
        )
    for steps in args.steps[1:]:
        ratios = [base / this for base, this in zip(times[first], times[steps])]
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        print(f"steps {first} / steps {steps}: median {statistics.median(ratios):.3f} ({spread})")
    print("same tokens:", all(tokens[steps] == tokens[first] for steps in args.steps))


if __name__ == "__main__":
    main()
