"""Decode buckets: the base model's offline throughput under different ladders of recorded
decode sizes (``cuda_graph_sizes``: native tapes on cpu-native), side by side in one run, and
what each ladder costs at start-up.

    python benchmarks/decode_buckets.py [--ladders default 1-8,16 eager] [--batches 9 12 16]
                                        [--prompt-len 32] [--output-len 32] [--repeats 3]
                                        [--quantization unquantized] [--threads 1]

A ladder is ``default`` (the platform's sizes), ``eager`` (``enforce_eager``: no recordings) or
sizes such as ``1-8,16`` or ``1,2,4,8,16``. A step of n requests replays the smallest recorded
size that holds n, padded to it, and runs eagerly above the largest: so a ladder decides, for
every batch size, between padding rows (real matmul work on a CPU) and the eager path (a Python
call per kernel).

Start-up: each ladder's engine is built ``--startup-rounds`` times, the ladders in turn (after
one engine built and dropped, so that no ladder pays the kernels' first build), timed from the
``LLM`` call to its return (the recordings are made in it). Throughput: one engine per ladder,
all loaded at once; every round runs each batch size through each ladder in turn (on a shared
machine the load drifts over minutes), and each ladder's tok/s is divided by the first ladder's
in the same round, by the wall clock and by process CPU time (with ``--threads 1`` the work
done); the medians print. Prompts are random token ids, EOS ignored, greedy.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

BLOCK = 16


def parse_ladder(spec: str) -> tuple[int, ...] | str:
    """``default`` / ``eager``, or the sizes of ``1-8,16`` (ranges and single sizes)."""
    if spec in ("default", "eager"):
        return spec
    sizes: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        sizes.update(range(int(first), int(last or first) + 1))
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"ladder {spec!r}: sizes must be positive")
    return tuple(sorted(sizes))


def engine_options(ladder, args) -> dict:
    tokens = args.prompt_len + args.output_len
    options = dict(
        seed=0,
        max_model_len=tokens,
        block_size=BLOCK,
        num_blocks=max(args.batches) * -(-tokens // BLOCK) + 16,
        max_num_seqs=max(args.batches),
    )
    if args.quantization:
        options["quantization"] = args.quantization
    if ladder == "eager":
        options["enforce_eager"] = True
    elif ladder != "default":
        options["cuda_graph_sizes"] = ladder
    return options


def time_startup(ladders: dict, args) -> dict[str, list[float]]:
    """Per ladder, the seconds of each build of its engine."""
    from engine import LLM

    LLM(**engine_options("default", args))  # the kernels built and cached once, for no one's count
    gc.collect()
    builds: dict[str, list[float]] = {name: [] for name in ladders}
    for _ in range(args.startup_rounds):
        for name, ladder in ladders.items():
            start = time.perf_counter()
            llm = LLM(**engine_options(ladder, args))
            builds[name].append(time.perf_counter() - start)
            del llm
            gc.collect()
    return builds


def run_once(llm, prompts, params) -> tuple[float, float]:
    """Output tok/s of one ``generate``, by the wall clock and by this process's CPU time."""
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)


def measure_throughput(ladders: dict, args) -> dict[tuple[str, int], list[tuple[float, float]]]:
    """Per (ladder, batch size), the (wall, CPU) tok/s of each round."""
    import torch

    from engine import LLM, SamplingParams

    engines = {name: LLM(**engine_options(ladder, args)) for name, ladder in ladders.items()}
    gen = torch.Generator().manual_seed(1)
    prompts = [
        {"prompt_token_ids": torch.randint(100, 20000, (args.prompt_len,), generator=gen).tolist()}
        for _ in range(max(args.batches))
    ]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for llm in engines.values():  # warm-up
        run_once(llm, prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    rates: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for round_ in range(args.repeats):
        for batch in args.batches:
            for name, llm in engines.items():
                rates.setdefault((name, batch), []).append(run_once(llm, prompts[:batch], params))
        print(
            f"round {round_ + 1}: " + "; ".join(f"{n}@{b} {r[-1][0]:.1f}" for (n, b), r in rates.items()),
            flush=True,
        )
    return rates


def paired_ratio(values: list[float], first: list[float]) -> float:
    """The median over rounds of each round's ratio to the first ladder's same round."""
    return statistics.median(v / f for v, f in zip(values, first))


def report(ladders: dict, builds: dict, rates: dict, args) -> None:
    first = next(iter(ladders))
    if builds:
        print(f"\nstart-up: the LLM call, median of {args.startup_rounds} builds")
        for name, runs in builds.items():
            print(f"{name:>14} | {statistics.median(runs):6.2f} s")
    print(
        f"\n{args.prompt_len}-token prompts, {args.output_len} tokens out; median of {args.repeats} "
        f"rounds; output tok/s; per round / {first}, the median (wall | CPU time)"
    )
    for batch in args.batches:
        for name in ladders:
            walls = [w for w, _ in rates[name, batch]]
            cpus = [c for _, c in rates[name, batch]]
            base_walls = [w for w, _ in rates[first, batch]]
            base_cpus = [c for _, c in rates[first, batch]]
            print(
                f"batch {batch:>3} | {name:>14} | {statistics.median(walls):7.1f} | "
                f"{paired_ratio(walls, base_walls):.3f} | {paired_ratio(cpus, base_cpus):.3f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--ladders",
        nargs="+",
        default=["default", "1-8,16"],
        help="recorded sizes per engine; ratios are taken against the first (default: default 1-8,16)",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[9, 12, 16], help="requests per generate")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the median counts (default 3)")
    parser.add_argument("--startup-rounds", type=int, default=2, help="builds per ladder timed (0: none)")
    parser.add_argument("--quantization", help="e.g. unquantized (bf16); default: the GGUF kept quantized")
    parser.add_argument("--threads", type=int, help="threads of every engine (default: all cores)")
    args = parser.parse_args()
    ladders = {spec: parse_ladder(spec) for spec in args.ladders}
    if args.threads:
        os.environ["ENGINE_NUM_THREADS"] = str(args.threads)  # the CPU platform sets torch's threads
    builds = time_startup(ladders, args) if args.startup_rounds else {}
    rates = measure_throughput(ladders, args)
    report(ladders, builds, rates, args)


if __name__ == "__main__":
    main()
