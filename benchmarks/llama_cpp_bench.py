"""llama.cpp's side of the benchmarks that compare with it (``llama-cpp-python``): single-stream
decode tokens/s and sequential batched throughput on a GGUF file, in this interpreter or, run as a
script, in another one.

    VENV/bin/python benchmarks/llama_cpp_bench.py MODEL.gguf [--threads N] [--single-len 128] [--repeats 3]

llama-cpp-python may live in a virtual environment of its own (``make llama-cpp`` builds it from
source); the script form lets a benchmark running in the engine's interpreter time llama.cpp in
that one (``single_stream_in``). It imports nothing of the engine, and prints one line
``RESULT {"tokens_per_s": ..., "tokens": ...}``.

Single-stream decode speed excludes the prompt, as the engine's does in ``quant.py``: the chat
completion is streamed, and the speed is the tokens between the first token's chunk and the last
token's over the time between them; the fastest of ``repeats`` runs counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT = "Write a long story about a lighthouse keeper and the sea."
RESULT = "RESULT "


def load(path: str, threads: int):
    """The GGUF file in llama.cpp with ``threads`` threads, or None when llama-cpp-python is not
    installed in this interpreter."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(model_path=path, n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)


def single_stream(llm, single_len: int, repeats: int) -> tuple[float, int]:
    """(decode tokens/s of one stream, the fastest of ``repeats`` runs; tokens the last run made)."""
    messages = [{"role": "user", "content": PROMPT}]
    llm.create_chat_completion(messages, max_tokens=4, temperature=0)
    best = 0.0
    for _ in range(repeats):
        times = []
        for _ in llm.create_chat_completion(messages, max_tokens=single_len, temperature=0, stream=True):
            times.append(time.perf_counter())
        best = max(best, (len(times) - 3) / (times[-2] - times[1]))  # chunk 0: the role; last: finish
    return best, len(times) - 2


def sequential_batch(llm, prompts: list[str], output_len: int) -> float:
    """Generated tokens/s of the prompts one after another: llama-cpp-python serves one sequence
    at a time."""
    start, tokens = time.perf_counter(), 0
    for p in prompts:
        llm.reset()
        out = llm.create_completion(p, max_tokens=output_len, temperature=0)
        tokens += out["usage"]["completion_tokens"]
    return tokens / (time.perf_counter() - start)


def single_stream_in(
    python: str, path: str, threads: int, single_len: int, repeats: int
) -> tuple[float, int]:
    """``single_stream`` run by the interpreter ``python`` (which has llama-cpp-python) on ``path``,
    in a subprocess of its own."""
    command = [python, os.path.abspath(__file__), path, "--threads", str(threads)]
    command += ["--single-len", str(single_len), "--repeats", str(repeats)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        raise RuntimeError(f"llama.cpp under {python} failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(lines[-1][len(RESULT) :])
    return result["tokens_per_s"], result["tokens"]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--single-len", type=int, default=128, help="tokens of a decode run")
    parser.add_argument("--repeats", type=int, default=3, help="decode runs; the fastest counts")
    args = parser.parse_args()
    llm = load(args.model, args.threads)
    if llm is None:
        sys.exit(f"llama-cpp-python is not installed in {sys.executable}")
    tokens_per_s, tokens = single_stream(llm, args.single_len, args.repeats)
    print(RESULT + json.dumps({"tokens_per_s": tokens_per_s, "tokens": tokens}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
