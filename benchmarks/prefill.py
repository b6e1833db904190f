"""Long-prompt prefill, side by side in one run, on the embedded default model (GGUF kept
quantized): this engine's prefill tokens/s against llama.cpp's (``llama-cpp-python``, built
from source by ``make llama-cpp``) on the same ~8k-token prompt and the same GGUF file, and
the inter-token gap of other streams while this engine prefills that prompt.

    python benchmarks/prefill.py [--prompt-len 8000] [--streams 3] [--skip-llama-cpp]
                                 [--option NAME=VALUE ...]

Prefill tokens/s is the prompt's length over the time of a 1-token completion of it, with
nothing else running (prefix caching off, so the prompt is computed each time). The gap is
measured in-process on the engine's step loop: ``--streams`` requests decode, the long
prompt arrives, and every gap between two consecutive tokens of a stream, from the prompt's
arrival to its first token, counts; the prompt's own rate under that load is printed too.
``--option`` passes an engine option (``shared_step_target_s=0`` is the old policy: prefill
chunks take the whole budget).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

WORDS = [
    "the",
    "keeper",
    "climbed",
    "the",
    "stairs",
    "of",
    "the",
    "lighthouse",
    "every",
    "evening",
    "and",
    "wrote",
    "down",
    "what",
    "the",
    "sea",
    "had",
    "brought",
    "to",
    "the",
    "shore",
    "that",
    "day",
]


def long_prompt(tokenizer, length: int) -> list[int]:
    """Deterministic text of exactly ``length`` tokens (numbers keep it from repeating)."""
    text = " ".join(f"{WORDS[j % len(WORDS)]} {j}" for j in range(length))
    return tokenizer.encode(text)[:length]


def engine_prefill(llm, prompt: list[int]) -> float:
    from engine import SamplingParams

    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    return len(prompt) / (time.perf_counter() - start)


def gaps_under_prefill(llm, prompt: list[int], streams: int) -> tuple[list[float], float]:
    """The streams' inter-token gaps while ``prompt`` prefills, and the prompt's tokens/s."""
    from engine import SamplingParams
    from engine.messages.request import Request

    core = llm.engine
    stream_params = SamplingParams(max_tokens=4096, temperature=0, ignore_eos=True)
    for i in range(streams):
        core.add_request(Request(f"stream{i}", prompt[10 * i : 10 * i + 20], stream_params))
    for _ in range(3):  # the streams' prompts, then decoding
        core.step()
    core.add_request(Request("long", prompt, SamplingParams(max_tokens=1, temperature=0)))
    arrived = last = time.perf_counter()
    last_token = {f"stream{i}": arrived for i in range(streams)}
    gaps: list[float] = []
    done = False
    while not done:
        outputs = core.step()
        last = time.perf_counter()
        for out in outputs:
            if out.request_id == "long":
                done = bool(out.new_token_ids)
            elif out.new_token_ids:
                gaps.append(last - last_token[out.request_id])
                last_token[out.request_id] = last
    core.abort(list(last_token))
    while core.has_unfinished():
        core.step()
    return gaps, len(prompt) / (last - arrived)


def llama_cpp_prefill(path: str, prompt: list[int]) -> float | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_ctx=len(prompt) + 16, n_threads=os.cpu_count(), verbose=False)
    llm.eval(prompt[:64])  # warm-up
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    return len(prompt) / (time.perf_counter() - start)


def _option(text: str) -> tuple[str, object]:
    name, _, value = text.partition("=")
    for kind in (int, float):
        try:
            return name, kind(value)
        except ValueError:
            pass
    return name, value


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=8000)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument(
        "--option", type=_option, action="append", default=[], help="engine option NAME=VALUE"
    )
    args = parser.parse_args()
    from engine import LLM, SamplingParams
    from engine_quant_gguf.loader import default_model_path

    llm = LLM(max_model_len=8192, enable_prefix_caching=False, **dict(args.option))
    prompt = long_prompt(llm.tokenizer, args.prompt_len)
    llm.generate([prompt[:64]], SamplingParams(max_tokens=2))  # warm-up
    ours = engine_prefill(llm, prompt)
    print(f"engine    prefill: {ours:7.1f} tok/s ({len(prompt)} tokens, alone)", flush=True)
    theirs = None if args.skip_llama_cpp else llama_cpp_prefill(default_model_path(), prompt)
    if theirs is None:
        print(
            "llama.cpp prefill: " + ("skipped" if args.skip_llama_cpp else "not installed (make llama-cpp)")
        )
    else:
        print(f"llama.cpp prefill: {theirs:7.1f} tok/s   engine ÷ llama.cpp: {ours / theirs:.2f}", flush=True)
    if args.streams:
        gaps, rate = gaps_under_prefill(llm, prompt, args.streams)
        print(
            f"{args.streams} streams decoding while it prefills: inter-token gap"
            f" p50 {percentile(gaps, 50):.3f} s  p99 {percentile(gaps, 99):.3f} s  max {max(gaps):.3f} s"
            f" ({len(gaps)} gaps); the prompt's prefill {rate:.1f} tok/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
