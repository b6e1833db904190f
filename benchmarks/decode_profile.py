"""Where one decode step goes, at each batch size: its C kernels by name, the torch ops between
them, and the rest (Python: scheduling, dispatch, output handling).

    python benchmarks/decode_profile.py [--batches 1 16] [--steps 20] [--dtype auto]
                                        [--kv-cache-dtype auto] [--batch-invariant]
                                        [--model default|default-bf16|1b-q4_1|1b-bf16]

Two engines on one model, one after the other (the default model's default config, ``LLM()``
as ``engine serve`` picks it, or the 1B-class model of ``random_llama.py``: its GGUF Q4_1 file
kept quantized, or its bf16 folder), one decode step a scheduling pass as ``engine serve``
runs them (``num_scheduler_steps=1``: ``LLM``'s default of 8 would time a burst of 8 steps);
``--batch-invariant`` runs both under that mode:
- as shipped (native tapes where the batch has one): the wall time of a decode step, and the
  process's minor page faults a step after a first run of the batch (whose prefill grows the
  heap once): memory the allocator maps afresh every step shows here;
- eager, under torch's profiler, each native kernel call wrapped in a ``record_function`` of its
  name, so C kernels and torch ops share one table of self times per step; what the table does
  not hold is Python. A tape replays the same C kernels without the Python between them, so the
  eager step's kernel times are the tape's too.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(__file__))

import random_llama


def timed_kernels() -> None:
    """Every bound native kernel call as a profiler range named after its kernel."""
    import torch

    from engine.native import tape

    call = tape.NativeKernel.__call__

    def timed(self, *args):
        with torch.profiler.record_function(f"C {self.name}"):
            return call(self, *args)

    tape.NativeKernel.__call__ = timed


def shares(llm, prompts, steps: int) -> tuple[float, dict[str, float]]:
    """(mean eager step seconds under the profiler, self seconds per step of each op name)."""
    from offline_throughput import decode_steps
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    times = decode_steps(llm, prompts, steps, prof)
    per_op: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        per_op[event.key] += event.self_cpu_time_total / 1e6 / steps
    return sum(times) / steps, per_op


def shipped_steps(llm, prompts, steps: int) -> tuple[float, float]:
    """The median wall time of a decode step as shipped, and the minor page faults a step."""
    from offline_throughput import decode_steps

    decode_steps(llm, prompts, 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = sorted(decode_steps(llm, prompts, steps))
    return times[steps // 2], (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps


def report(batch: int, shipped: tuple[float, float], eager_s: float, per_op: dict[str, float]) -> None:
    (shipped_s, faults), eager_ms = shipped, eager_s * 1e3
    print(
        f"\nbatch {batch}: decode step {shipped_s * 1e3:.2f} ms as shipped ({faults:.0f} minor page faults a "
        f"step), {eager_ms:.2f} ms eager profiled"
    )
    for name, seconds in sorted(per_op.items(), key=lambda item: -item[1])[:25]:
        print(f"  {name[:48]:48s} {seconds * 1e6:9.1f} us  {seconds / eager_s:6.1%}")
    rest = eager_s - sum(per_op.values())
    print(f"  {'(Python, outside every op)':48s} {rest * 1e6:9.1f} us  {rest / eager_s:6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's (fp8: e4m3 pages)")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="both engines under --batch-invariant (the mode's kernels)",
    )
    parser.add_argument(
        "--model",
        choices=["default", "default-bf16", "1b-q4_1", "1b-bf16"],
        default="default",
        help="the embedded default model (default-bf16: dequantized to bf16, the bf16 config), or the "
        "1B-class one (built once and cached) as GGUF Q4_1 or bf16",
    )
    args = parser.parse_args()

    from offline_throughput import decode_steps, make_prompts

    from engine import LLM

    path = None if args.model.startswith("default") else random_llama.row_path(args.model)
    # the 1B-class model's own 8192 positions need not fit beside a batch of 256
    options = dict(
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=2048 if path else None,
        batch_invariant=args.batch_invariant,
        num_scheduler_steps=1,
    )
    if args.model == "default-bf16":
        options["quantization"] = "unquantized"
    shipped = LLM(path, **options)
    prompts = make_prompts(shipped.tokenizer, max(args.batches))
    model, cache = shipped.config.model, shipped.config.cache
    print(f"model {model.model}, dtype {model.dtype}, KV cache {cache.kv_cache_dtype}")
    wall = {b: shipped_steps(shipped, prompts[:b], args.steps) for b in args.batches}
    del shipped
    timed_kernels()
    eager = LLM(path, enforce_eager=True, **options)
    for batch in args.batches:
        decode_steps(eager, prompts[:batch], 2)  # warm
        eager_s, per_op = shares(eager, prompts[:batch], args.steps)
        report(batch, wall[batch], eager_s, per_op)


if __name__ == "__main__":
    main()
