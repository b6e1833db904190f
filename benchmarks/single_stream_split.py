"""Where a single-stream token goes: ``LLM.generate`` of one prompt (128 tokens, greedy, EOS
ignored) on the default config, split into the native tape's kernels, the LM head and the
Python around them, per token.

    ENGINE_NUM_THREADS=1 python benchmarks/single_stream_split.py [--rounds 4] [--tokens 128] [--prompts 1]
                                                                  [--model PATH] [--plain-only]

Three passes over the same prompt, after a warm-up:
- plain: the whole ``generate``, nothing wrapped;
- parts: the engine's functions below wrapped, each one's inclusive time summed (a part's
  figure holds the parts it calls);
- kernels: the tape replayed one kernel call at a time (one C call each, ~1-1.5 us of ctypes
  on top of each kernel), summed by kernel and, for the matmuls, by shape (n × k).
``--plain-only`` runs the first pass alone and prints each round's figure and their best and
median: run it on two trees' processes in turn, several times, to compare them (the pairs'
ratios; a process's figures move with the machine's memory from minute to minute).
With ``--prompts N`` above 1, N prompts decode side by side and the figures are per decode step
(each step makes N tokens).
One thread: thread CPU time, which other processes on a shared machine move far less than wall
time. More threads: wall time (CPU time would add the workers' spinning).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import importlib
import statistics
import time

importlib.import_module("engine")  # before torch: the engine sets OpenMP's wait policy before libgomp loads
import torch

from engine import LLM, SamplingParams
from engine.native import tape

PROMPT = "The history of the city begins with"
# (module, attribute path): the engine's per-step functions, outermost first
PARTS = [
    ("engine.entrypoints.llm", "LLM._step"),
    ("engine.client.output_processor", "OutputProcessor.feed"),
    ("engine.core.engine_core", "EngineCore.step"),
    ("engine.core.lifecycle", "RequestLifecycle.schedule"),
    ("engine.core.lifecycle", "RequestLifecycle.apply"),
    ("engine.runner.model_runner", "ModelRunner.execute"),
    ("engine.runner.model_runner", "flatten"),
    ("engine.runner.step_graphs", "StepGraphRunner.replay"),
    ("engine.runner.step_graphs", "StepGraphRunner.replay_greedy"),
    ("engine.native.tape", "Tape.replay"),
    ("engine.layers.decoder", "DecoderForCausalLM.compute_logits"),
    ("engine.layers.decoder", "DecoderForCausalLM.compute_greedy"),
    ("engine.runner.model_runner", "ModelRunner._sample"),
]


def clock_for(threads: int):
    return time.thread_time if threads == 1 else time.perf_counter


def wrap_parts(clock, totals: dict[str, float]) -> None:
    """Each of PARTS replaced by a wrapper adding its inclusive time to ``totals``."""
    for module_name, path in PARTS:
        owner_name, _, name = path.rpartition(".")
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        inner = getattr(owner, name)

        def timed(*args, _inner=inner, _path=path, **kwargs):
            start = clock()
            try:
                return _inner(*args, **kwargs)
            finally:
                totals[_path] += clock() - start

        setattr(owner, name, timed)


def kernel_key(recorded: tape.Tape, index: int) -> str:
    name = recorded.names[index]
    if name.startswith("affine_matmul"):
        # affine_matmul's integer arguments: x, ldx, m, k, qw, sz, form, bits, n, out
        op = recorded._ops[index]
        return f"{name} n={op.ints[8]} k={op.ints[3]}"
    return name


def replay_one_by_one(clock, totals: dict[str, float]) -> None:
    """Tape.replay as one C call per kernel, each timed into ``totals`` by :func:`kernel_key`."""
    run = tape._library().tape_run

    def replay(self):
        base, size = ctypes.addressof(self._ops), ctypes.sizeof(tape._Op)
        for index in range(len(self)):
            start = clock()
            failed = run(base + index * size, 1)
            totals[kernel_key(self, index)] += clock() - start
            if failed:
                raise tape.ReplayError(f"kernel {self.names[index]} refused its input")

    tape.Tape.replay = replay


def per_step_ms(llm, prompts: list[str], params, clock, rounds: int) -> float:
    start = clock()
    for _ in range(rounds):
        llm.generate(prompts, params, use_tqdm=False)
    return (clock() - start) / (rounds * params.max_tokens) * 1e3


def plain_rounds(llm, prompts: list[str], params, clock, rounds: int) -> None:
    """Each round's ms a token (step), then their best and median."""
    figures = [per_step_ms(llm, prompts, params, clock, 1) for _ in range(rounds)]
    print("rounds: " + " ".join(f"{f:.3f}" for f in figures))
    print(f"best {min(figures):.3f} median {statistics.median(figures):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4, help="generate calls per pass")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each prompt generates")
    parser.add_argument("--prompts", type=int, default=1, help="prompts decoded side by side")
    parser.add_argument("--plain-only", action="store_true", help="the plain pass alone, round by round")
    parser.add_argument(
        "--model",
        default=None,
        help="a GGUF file or model folder (default: the default model); "
        "random_llama.py makes the 1B-class ones",
    )
    args = parser.parse_args()

    llm = LLM(args.model, dtype="bfloat16", max_model_len=2048)
    threads = torch.get_num_threads()
    clock = clock_for(threads)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    prompts = [PROMPT] if args.prompts == 1 else [f"{PROMPT} number {i}" for i in range(args.prompts)]
    llm.generate(prompts, params, use_tqdm=False)
    tokens = args.rounds * args.tokens
    kind = "thread CPU" if threads == 1 else "wall"
    print(f"{threads} thread(s), {kind} ms per {'token' if args.prompts == 1 else 'step'}")
    if args.plain_only:
        plain_rounds(llm, prompts, params, clock, args.rounds)
        return
    print(f"plain generate: {per_step_ms(llm, prompts, params, clock, args.rounds):.3f}")

    parts: dict[str, float] = collections.defaultdict(float)
    wrap_parts(clock, parts)
    print(f"with the parts wrapped: {per_step_ms(llm, prompts, params, clock, args.rounds):.3f}")
    for _, path in PARTS:
        print(f"  {path:40s} {parts[path] / tokens * 1e3:7.3f}")

    kernels: dict[str, float] = collections.defaultdict(float)
    replay_one_by_one(clock, kernels)
    replayed = per_step_ms(llm, prompts, params, clock, args.rounds)
    print(f"with the tape replayed kernel by kernel: {replayed:.3f}")
    for key, seconds in sorted(kernels.items(), key=lambda item: -item[1]):
        print(f"  {key:40s} {seconds / tokens * 1e3:7.3f}")
    print(f"  {'(sum of the kernel calls)':40s} {sum(kernels.values()) / tokens * 1e3:7.3f}")


if __name__ == "__main__":
    main()
