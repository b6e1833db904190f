"""Tensor parallelism on this machine: TP=2 (two gloo ranks, one core each) against TP=1 (one
process, both cores), the same random Llama (or ``--model``) and prompts, side by side.

    python benchmarks/tp.py [--repeats 3] [--prompts 32] [--prompt-len 64] [--output-len 32]
                            [--model default|PATH] [--quantization NAME] [--dtype float32]
                            [--distributed-executor-backend mp|ray]

``--model default`` is the embedded default model (its 3 kv heads split 2 + 1); with
``--quantization`` unquantized (dequantized at load), int8-w8a16, int8-w8a8 or gguf (kept
quantized, the file's own). With ``--distributed-executor-backend ray``, rank 1 is a Ray actor
(the cluster ``RAY_ADDRESS`` names, the one on this machine, or a local one the engine starts);
the step's work is the same as ``mp``'s.

Both engines are built once and run interleaved (A B A B ...); each figure is the median
over ``--repeats`` rounds, and greedy outputs are compared: they must be equal where only
float rounding separates TP=2 from TP=1 (the random Llama, a dequantized or W8A16 model);
W8A8 and kept-quantized GGUF round activations to int8 per rank, so for them the count of
identical outputs is printed instead. TP=1 computes on both cores
(2 threads), and, as a control, on one; each TP=2 rank on one (rank 0 here, rank 1 in its
worker). Also printed: what
the design costs per step — the broadcast step input (measured), and the all-reduces and
logit gathers per token (from the model's shape).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from engine import LLM, SamplingParams
from engine.testing import reference

MODEL = dict(
    model_type="llama",
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    eos_token_id=2,
    bos_token_id=1,
)


def run(llm: LLM, threads: int, prompts, params) -> tuple[float, list[list[int]]]:
    """(generated tokens per second, outputs) with ``threads`` torch threads in this process."""
    torch.set_num_threads(threads)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def design_cost(executor, cfg, steps_before: int, bytes_before: int) -> str:
    hidden_bytes = cfg.hidden_size * 4  # float32 activations
    reduces = 2 * cfg.num_hidden_layers + 1  # o_proj and down_proj per layer, the vocab-parallel embedding
    steps = executor.steps_broadcast - steps_before
    per_step = (executor.step_bytes_broadcast - bytes_before) / max(steps, 1)
    return (
        f"per step: one step-input broadcast, {per_step / 1024:.1f} KiB on average over {steps} steps "
        f"(two gloo broadcasts: size, then the pickled tokens, positions and attention layouts); "
        f"{reduces} all-reduces a step, each {hidden_bytes} B per token of the step (hidden "
        f"{cfg.hidden_size} x float32); one logits gather a step, {-(-cfg.vocab_size // 2) * 4} B per "
        f"sampled token from each rank to rank 0"
    )


def _all_reduce_rank(rank: int, port: int, rows: tuple[int, ...], hidden: int, results) -> None:
    """One rank of the all-reduce micro-benchmark: median milliseconds per all-reduce of
    [rows, hidden] float32 over a gloo group on loopback, one thread, as the TP=2 ranks run."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), rank, 2, timeout)
    medians = {}
    for n in rows:
        x, times = torch.ones(n, hidden), []
        for _ in range(300):
            start = time.perf_counter()
            group.allreduce([x]).wait()
            times.append(time.perf_counter() - start)
        medians[n] = statistics.median(times[50:]) * 1e3
    if rank == 0:
        results.put(medians)


def all_reduce_latency(rows: tuple[int, ...], hidden: int) -> dict[int, float]:
    """Rows -> median ms of one all-reduce between two spawned single-threaded ranks."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ranks = [spawn.Process(target=_all_reduce_rank, args=(r, port, rows, hidden, results)) for r in range(2)]
    for process in ranks:
        process.start()
    medians = results.get(timeout=120)
    for process in ranks:
        process.join()
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--model",
        help="'default' (the embedded default model) or a path; default: a random Llama of MODEL's shape",
    )
    parser.add_argument("--quantization")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default="mp")
    args = parser.parse_args()
    cores = torch.get_num_threads()
    exact = args.quantization in (None, "unquantized", "int8-w8a16") and not (
        args.model == "default" and args.quantization is None
    )  # the default model is kept quantized
    with tempfile.TemporaryDirectory() as folder:
        if args.model is None:
            reference.tiny_checkpoint(folder, "LlamaForCausalLM", MODEL)
        model = None if args.model == "default" else args.model or folder
        options = dict(
            dtype=args.dtype,
            num_blocks=1024,
            block_size=16,
            max_model_len=512,
            quantization=args.quantization,
        )
        one = LLM(model, **options)
        two = LLM(
            model,
            tensor_parallel_size=2,
            distributed_executor_backend=args.distributed_executor_backend,
            **options,
        )
        executor, cfg = two.engine.executor, two.engine.hf_config
        for name, prompts in [
            ("batched", reference.random_prompts(cfg.vocab_size, [args.prompt_len] * args.prompts, seed=1)),
            ("single stream", reference.random_prompts(cfg.vocab_size, [args.prompt_len], seed=2)),
        ]:
            params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
            runs = {"TP=1": (one, cores), "TP=1, 1 thread": (one, 1), "TP=2": (two, max(1, cores // 2))}
            rates: dict[str, list[float]] = {label: [] for label in runs}
            steps, sent = executor.steps_broadcast, executor.step_bytes_broadcast
            for _ in range(args.repeats):
                outputs = []
                for label, (llm, threads) in runs.items():
                    rate, out = run(llm, threads, prompts, params)
                    rates[label].append(rate)
                    outputs.append(out)
                if exact:
                    assert all(out == outputs[0] for out in outputs), "TP=2 greedy outputs differ from TP=1"
            same = sum(a == b for a, b in zip(outputs[0], outputs[2]))
            median = {label: statistics.median(r) for label, r in rates.items()}
            columns = " | ".join(f"{label} {rate:6.1f} tok/s" for label, rate in median.items())
            print(
                f"{name:>13} ({len(prompts)} x {args.prompt_len} -> {args.output_len} tokens): {columns} | "
                f"TP=2/TP=1 {median['TP=2'] / median['TP=1']:.2f}x, "
                f"TP=2/(TP=1, 1 thread) {median['TP=2'] / median['TP=1, 1 thread']:.2f}x | "
                f"greedy outputs identical to TP=1: {same} of {len(prompts)}"
            )
            print(f"{'':>13} {design_cost(executor, cfg, steps, sent)}")
        two.engine.shutdown()
    latency = all_reduce_latency((1, args.prompts), cfg.hidden_size)
    print(
        "gloo all-reduce on loopback, two single-threaded ranks: "
        + ", ".join(f"[{n}, {cfg.hidden_size}] float32 {ms:.3f} ms" for n, ms in latency.items())
        + f" (median of 250); x{2 * cfg.num_hidden_layers + 1} a step"
    )


if __name__ == "__main__":
    main()
