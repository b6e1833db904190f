"""Decode tokens/s under OpenMP wait settings and thread counts, at batch 1 and 16, each cell in
its own process (libgomp reads its environment once, when torch loads it), the cells alternated
round by round so that the machine's drift falls on all of them alike.

    python benchmarks/omp_wait.py [--cells engine@1 engine@2 passive@2 spin=1000@2 ...]
                                  [--rounds 3] [--steps 32 16]

A cell is SETTING@THREADS (``ENGINE_NUM_THREADS``). A setting is ``engine`` (no OpenMP variable
set: what the engine chooses), ``passive`` or ``active`` (``OMP_WAIT_POLICY``), or ``spin=N``
(``GOMP_SPINCOUNT=N``; libgomp's own default, when neither variable is set, is
``spin=300000``). With one thread there is no thread to wait, so the setting does not matter
there. Each process builds the default config
(the embedded GGUF kept quantized) and times ``--steps`` decode steps with 1 and with 16
requests decoding (``offline_throughput.decode_steps``); a figure is batch ÷ the median step
time, and the table prints each cell's median over the rounds with its range. The load
average is printed before and after: on a machine shared with other processes the spinning
of waiting threads is what these settings change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))

OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
BATCHES = (1, 16)


def setting_environment(setting: str) -> dict[str, str]:
    """The OpenMP variables ``setting`` names (none for ``engine``)."""
    if setting == "engine":
        return {}
    if setting in ("passive", "active"):
        return {"OMP_WAIT_POLICY": setting.upper()}
    name, _, count = setting.partition("=")
    if name == "spin" and count.isdigit():
        return {"GOMP_SPINCOUNT": count}
    raise argparse.ArgumentTypeError(f"unknown setting {setting!r}: engine, passive, active or spin=N")


def parse_cell(cell: str) -> tuple[str, int]:
    setting, _, threads = cell.rpartition("@")
    if not threads.isdigit() or int(threads) < 1:
        raise argparse.ArgumentTypeError(f"{cell!r} is not SETTING@THREADS")
    setting_environment(setting)
    return setting, int(threads)


def measure(steps: tuple[int, int]) -> dict[int, float]:
    """Decode tokens/s of this process at each batch size."""
    from offline_throughput import decode_steps, make_prompts

    from engine import LLM

    llm = LLM(enable_prefix_caching=False)
    prompts = make_prompts(llm.tokenizer, max(BATCHES))
    return {
        batch: batch / statistics.median(decode_steps(llm, prompts[:batch], count))
        for batch, count in zip(BATCHES, steps)
    }


def run_child(setting: str, threads: int, steps: tuple[int, int]) -> dict[int, float]:
    env = {key: value for key, value in os.environ.items() if key not in OPENMP_VARIABLES}
    env.update(setting_environment(setting), ENGINE_NUM_THREADS=str(threads))
    command = [sys.executable, __file__, "--child", "--steps", *map(str, steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    result = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if done.returncode != 0 or result is None:
        sys.exit(f"{setting} at {threads} threads failed:\n{done.stderr[-3000:]}")
    return {int(batch): rate for batch, rate in json.loads(result[len("RESULT ") :]).items()}


def load() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cells",
        nargs="+",
        type=parse_cell,
        default=[("engine", 1), ("engine", 2), ("passive", 2), ("spin=300000", 2)],
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, nargs=2, default=[32, 16], help="steps timed at batch 1 and 16")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = tuple(args.steps)
    if args.child:
        print("RESULT " + json.dumps(measure(steps)), flush=True)
        return
    cells = args.cells
    rates: dict[tuple[str, int], dict[int, list[float]]] = {cell: {b: [] for b in BATCHES} for cell in cells}
    print(f"load average before: {load()}", flush=True)
    for round_number in range(1, args.rounds + 1):
        for setting, threads in cells:
            measured = run_child(setting, threads, steps)
            for batch, rate in measured.items():
                rates[setting, threads][batch].append(rate)
            figures = " ".join(f"b{b} {rate:.1f}" for b, rate in measured.items())
            print(f"round {round_number}: {setting} {threads}t {figures} tok/s (load {load()})", flush=True)
    print(f"load average after: {load()}\n")
    print(f"{'setting':>14} | threads | " + " | ".join(f"batch {b} tok/s (range)" for b in BATCHES))
    for setting, threads in cells:
        columns = [
            f"{statistics.median(r):>7.1f} ({min(r):.1f}–{max(r):.1f})"
            for r in rates[setting, threads].values()
        ]
        print(f"{setting:>14} | {threads:>7} | " + " | ".join(columns))


if __name__ == "__main__":
    main()
