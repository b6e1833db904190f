"""Greedy decode with its tokens on the step's recording against the forward's recording alone,
in one process: the same engine, its buckets' greedy recordings held back in every other round.

    python benchmarks/greedy_tape.py [--model PATH] [--prompts 1] [--tokens 128] [--rounds 10]

Each round generates ``--prompts`` prompts of ``--tokens`` greedy tokens (EOS ignored) twice,
once each way, the order alternating round by round, so that a shared machine's bandwidth moves
both alike. "greedy tape": a decode step replays its bucket's recording of the forward, the LM
head and the argmax (``StepGraphRunner.replay_greedy``); "forward tape": the forward's
recording, then the head and the argmax called from Python, as before the greedy recordings.
Prints each way's ms per decode step (wall time; thread CPU time with ``ENGINE_NUM_THREADS=1``)
round by round, the per-round ratios and their median, and whether both gave the same tokens.
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="a GGUF file or model folder (default: the default model)"
    )
    parser.add_argument("--prompts", type=int, default=1, help="prompts decoded side by side")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each prompt generates")
    parser.add_argument("--rounds", type=int, default=10, help="rounds, each running both ways once")
    args = parser.parse_args()

    llm = LLM(args.model, dtype="bfloat16", max_model_len=2048)
    graphs = llm.engine.runner.graphs
    if graphs is None or not any(r.greedy is not None for r in graphs.graphs.values()):
        raise SystemExit(
            "this engine records no greedy decode steps (no step graphs, or its head is not recordable)"
        )
    recorded = dict(graphs.graphs)
    held_back = {size: attrs.evolve(r, greedy=None, tokens=None) for size, r in recorded.items()}
    clock = time.thread_time if os.environ.get("ENGINE_NUM_THREADS") == "1" else time.perf_counter
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    prompts = [PROMPT] if args.prompts == 1 else [f"{PROMPT} number {i}" for i in range(args.prompts)]
    llm.generate(prompts, params, use_tqdm=False)

    ways = {"greedy tape": recorded, "forward tape": held_back}
    times: dict[str, list[float]] = {way: [] for way in ways}
    tokens: dict[str, list] = {}
    for round_ in range(args.rounds):
        for way in list(ways)[:: 1 if round_ % 2 == 0 else -1]:
            graphs.graphs.update(ways[way])
            start = clock()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            times[way].append((clock() - start) / args.tokens * 1e3)
            tokens[way] = [o.outputs[0].token_ids for o in outputs]
    graphs.graphs.update(recorded)

    kind = "thread CPU" if clock is time.thread_time else "wall"
    print(f"{args.prompts} prompt(s), {kind} ms per decode step, round by round")
    for way, figures in times.items():
        print(f"  {way:13s} median {statistics.median(figures):7.3f}:", " ".join(f"{t:.3f}" for t in figures))
    ratios = [slow / fast for fast, slow in zip(times["greedy tape"], times["forward tape"])]
    spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
    print(f"forward tape / greedy tape: median {statistics.median(ratios):.3f} ({spread})")
    print("same tokens:", tokens["greedy tape"] == tokens["forward tape"])


if __name__ == "__main__":
    main()
