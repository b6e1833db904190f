"""Every side-by-side figure of the CPU speed and quality table (issue 24) in one run, on
whatever machine this is: the CPU's kind first, then each benchmark in turn, its own output
streamed, with the load average before and after it.

    python benchmarks/speed_table.py --vllm-python VLLM_VENV/bin/python
                                     --llama-python LLAMA_VENV/bin/python [--only ROW ...]
                                     [--dry-run]

Rows (``--only`` picks some; all by default, in this order):
- ``offline``: default and bf16 against vLLM's CPU build, 64 and 256 prompts × 128 tokens;
- ``online``: ``vllm bench serve`` 128/128, 64 prompts, rate inf, default and bf16 servers
  against ``vllm serve``;
- ``batches``: the default config against bf16 at batch 1, 16, 64 and 256 (decode steps);
- ``invariant``: bf16 with and without ``--batch-invariant`` (64 × 128, engine only);
- ``1b-offline``: the 1B-class model, default (GGUF Q4_1) and bf16 against vLLM, 16 × 32 (vLLM
  emulates bf16 on CPUs without it, where 64 × 128 takes it hours);
- ``floor``: single stream against the memory-bandwidth floor and llama.cpp, both model sizes;
- ``quality``: KL divergence and top-1 agreement against the float32 reference, beside
  llama.cpp on the same GGUF file.
Without ``--vllm-python`` the vLLM sides are skipped (each benchmark says so), without
``--llama-python`` llama.cpp's. A full run takes one to three hours on a CPU without AMX, mostly
vLLM's (16 minutes on a 2-core AMX Xeon). Record the figures with the machine's kind in
benchmarks/RESULTS.md; say which rows ran together.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


# each row's command line; {vllm} and {llama} name the other engines' interpreters (or nothing)
ROWS = {
    "offline": "vs_vllm.py offline --num-prompts 64 256 --configs default bf16 {vllm}",
    "online": "vs_vllm.py online --num-prompts 64 --configs default bf16 {vllm}",
    "batches": "quant_batches.py --batches 1 16 64 256 --configs default",
    "invariant": "vs_vllm.py offline --num-prompts 64 --configs bf16 bf16-invariant",
    "1b-offline": "vs_vllm.py offline --model 1b --num-prompts 16 --output-len 32 --configs default bf16"
    " {vllm}",
    "floor": "bandwidth_floor.py --repeats 3 --output-len 64 {llama}",
    "quality": "quality.py {llama}",
}


def cpu_kind() -> str:
    """The CPU's model name and which of CPU_FLAGS it has (Linux's /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown CPU (no /proc/cpuinfo)"
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    name = fields.get("model name\t", "?").strip()
    flags = fields.get("flags\t\t", "").split()
    present = [flag for flag in CPU_FLAGS if flag in flags]
    return f"{name}, {os.cpu_count()} CPUs; flags: {' '.join(present) or 'none of ' + ' '.join(CPU_FLAGS)}"


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-python", help="python of vLLM's CPU build (vs_vllm.py --help has the set-up)")
    parser.add_argument("--llama-python", help="python of a virtual environment with llama-cpp-python")
    parser.add_argument("--only", nargs="+", metavar="ROW", help="rows to run (default: every row, in order)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    args = parser.parse_args()

    vllm = f"--vllm-python {shlex.quote(args.vllm_python)}" if args.vllm_python else ""
    llama = f"--llama-python {shlex.quote(args.llama_python)}" if args.llama_python else ""
    unknown = sorted(set(args.only or ()) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {', '.join(unknown)} (rows: {', '.join(ROWS)})")
    print(f"machine: {cpu_kind()}", flush=True)
    failed = []
    for name in args.only or ROWS:
        script, *options = shlex.split(ROWS[name].format(vllm=vllm, llama=llama))
        command = [sys.executable, os.path.join(HERE, script), *options]
        print(f"\n== {name}: python benchmarks/{shlex.join([script, *options])}", flush=True)
        if args.dry_run:
            continue
        start, before = time.monotonic(), load()
        code = subprocess.call(command, cwd=os.path.dirname(HERE))
        took = time.monotonic() - start
        print(f"== {name}: exit {code}, {took:.0f} s, load {before} -> {load()}", flush=True)
        if code:
            failed.append(name)
    if failed:
        sys.exit(f"rows that failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
