"""Quantized paths side by side, one run, on the embedded default model: single-stream decode
tokens/s and 64-request batched throughput for bf16, int8 (W8A16 and W8A8), GGUF kept
quantized, AWQ and GPTQ checkpoints of the same weights, and llama.cpp (``llama-cpp-python``,
built from source by ``make llama-cpp``) on the same GGUF file when it is installed.

    python benchmarks/quant.py [--num-prompts 64] [--output-len 128] [--single-len 128]
                               [--repeats 3] [--batched-repeats 2] [--only NAME ...] [--threads N]
                               [--interleaved]

bf16 and int8 start from the GGUF weights dequantized (``quantization="unquantized"`` / the
int8 methods quantize those online); "gguf" keeps the file's Q4_1/Q8_0 blocks; "awq" and
"gptq" load those dequantized weights exported as 4-bit group-32 checkpoints (AWQ GEMM, GPTQ v1
symmetric; the tied embedding stays bf16 as such checkpoints keep it), and "gguf-float-vocab" the
same weights as GGUF Q4_1 with that table in float, all written once and cached beside the GGUF
cache (``awq_gptq_export.py``). Single-stream
decode speed excludes the prompt: (tokens − 1) / (time to last token − time to first), the
fastest of ``--repeats`` runs for every engine alike (this machine's run-to-run spread is ±10 %);
batched throughput of the engine configs the fastest of ``--batched-repeats`` (llama.cpp's
sequential batch runs once: it takes a minute and is not a goal).
Resident weight memory is the bytes of the model's parameters and buffers.

``--interleaved`` measures single-stream decode only, with every engine config loaded at once
and each run in turn, round after round (``--repeats`` rounds; the fastest round of each
counts): on a shared machine the load changes over minutes, and configs measured one after
another compare different moments.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import awq_gptq_export
import llama_cpp_bench
from llama_cpp_bench import PROMPT
from offline_throughput import make_prompts

CONFIGS = {
    "bf16": dict(quantization="unquantized"),
    "int8-w8a16": dict(quantization="int8-w8a16"),
    "int8-w8a8": dict(quantization="int8-w8a8"),
    "gguf": dict(),
    "gguf-eager": dict(enforce_eager=True),
    "gguf-float-vocab": dict(export=awq_gptq_export.GGUF_FLOAT_VOCAB),
    "awq": dict(export=awq_gptq_export.AWQ),
    "gptq": dict(export=awq_gptq_export.GPTQ),
}


def engine_single(llm, output_len, repeats):
    """Decode tokens/s of one stream: (n − 1) tokens over the time a n-token run takes beyond
    a 1-token run of the same prompt (which is prefill and first token); each the fastest
    of ``repeats`` runs."""
    from engine import SamplingParams

    prompt = llm.apply_chat_template([{"role": "user", "content": PROMPT}])
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0))
    elapsed = {}
    for n in (1, output_len):
        for _ in range(repeats):
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            elapsed[n] = min(elapsed.get(n, float("inf")), time.perf_counter() - start)
    return (output_len - 1) / (elapsed[output_len] - elapsed[1])


def _engine_kwargs(name: str) -> dict:
    kwargs = CONFIGS[name]
    if "export" in kwargs:  # a checkpoint folder of the default model's weights
        return dict(model=awq_gptq_export.build(kwargs["export"]))
    return kwargs


def interleaved_single(names: list[str], output_len: int, rounds: int) -> dict[str, float]:
    """Single-stream decode tokens/s of each config, all loaded at once and run in turn."""
    from engine import LLM

    llms = {name: LLM(dtype="bfloat16", max_model_len=2048, **_engine_kwargs(name)) for name in names}
    best = dict.fromkeys(names, 0.0)
    for round_ in range(rounds):
        for name, llm in llms.items():
            best[name] = max(best[name], engine_single(llm, output_len, 1))
        print(f"round {round_ + 1}: " + "  ".join(f"{n} {t:.1f}" for n, t in best.items()), flush=True)
    return best


def engine_batched(llm, prompts, output_len, repeats):
    """Generated tokens/s of all prompts at once, the fastest of ``repeats`` runs."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    return best


def weight_mib(llm) -> float:
    model = llm.engine.model
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20


def llama_cpp_figures(path, prompts, output_len, single_len, repeats):
    """llama.cpp's (single-stream, sequential batched) tokens/s on the same file and threads as the
    engine's, or None when llama-cpp-python is not installed here."""
    threads = int(os.environ.get("ENGINE_NUM_THREADS", os.cpu_count()))  # the engine's, as --threads sets it
    llm = llama_cpp_bench.load(path, threads)
    if llm is None:
        return None
    single, _ = llama_cpp_bench.single_stream(llm, single_len, repeats)
    return single, llama_cpp_bench.sequential_batch(llm, prompts, output_len)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--single-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="single-stream runs; the fastest counts")
    parser.add_argument("--batched-repeats", type=int, default=2, help="batched runs of the engine configs")
    parser.add_argument(
        "--only", nargs="*", default=None, help="subset of: " + " ".join([*CONFIGS, "llama.cpp"])
    )
    parser.add_argument(
        "--interleaved", action="store_true", help="single-stream only, every config loaded at once, in turn"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads of every engine, llama.cpp included (default: all cores)",
    )
    args = parser.parse_args()
    if args.threads:
        os.environ["ENGINE_NUM_THREADS"] = str(args.threads)  # the CPU platform sets torch's threads
    import torch

    from engine import LLM
    from engine_quant_gguf.loader import default_model_path

    torch.manual_seed(0)
    if args.interleaved:
        names = [name for name in CONFIGS if not args.only or name in args.only]
        best = interleaved_single(names, args.single_len, args.repeats)
        print(f"\n{'config':>11} | single tok/s | ÷ {names[0]}")
        for name, single in best.items():
            print(f"{name:>11} | {single:12.1f} | {single / best[names[0]]:.2f}")
        return 0
    rows = {}
    for name in CONFIGS:
        if args.only and name not in args.only:
            continue
        llm = LLM(dtype="bfloat16", max_model_len=2048, **_engine_kwargs(name))
        prompts = make_prompts(llm.tokenizer, args.num_prompts)
        rows[name] = (
            engine_single(llm, args.single_len, args.repeats),
            engine_batched(llm, prompts, args.output_len, args.batched_repeats),
            weight_mib(llm),
        )
        print(
            f"{name:>11}: single {rows[name][0]:6.1f} tok/s  batched {rows[name][1]:6.1f} tok/s  "
            f"weights {rows[name][2]:6.1f} MiB",
            flush=True,
        )
        del llm
        gc.collect()
    if not args.only or "llama.cpp" in args.only:
        prompts = make_prompts(LLM(dtype="bfloat16", max_model_len=2048).tokenizer, args.num_prompts)
        figures = llama_cpp_figures(
            default_model_path(), prompts, args.output_len, args.single_len, args.repeats
        )
        if figures is None:
            print("  llama.cpp: not installed (make llama-cpp)")
        else:
            rows["llama.cpp"] = (*figures, float("nan"))
            print(
                f"{'llama.cpp':>11}: single {figures[0]:6.1f} tok/s  batched {figures[1]:6.1f} tok/s",
                flush=True,
            )
    base = rows.get("bf16")
    print(
        f"\n{'config':>11} | single tok/s | batched tok/s | weights MiB | single ÷ bf16 | batched ÷ bf16"
        + (" | single ÷ llama.cpp" if "llama.cpp" in rows else "")
    )
    for name, (single, batched, mib) in rows.items():
        line = f"{name:>11} | {single:12.1f} | {batched:13.1f} | {mib:11.1f}"
        if base:
            line += f" | {single / base[0]:13.2f} | {batched / base[1]:14.2f}"
        if "llama.cpp" in rows:
            line += f" | {single / rows['llama.cpp'][0]:18.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
