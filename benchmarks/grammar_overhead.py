"""Per-step cost of structured outputs: decode steps with a grammar vs without, at batch 1
and 32, on the embedded default model, measured side by side in one run.

    python benchmarks/grammar_overhead.py [--steps 40] [--dtype bfloat16]

The constrained requests use a JSON schema whose documents cannot end before the
measurement does, so every measured step fills and applies a bitmask for every row.
"""

from __future__ import annotations

import argparse
import statistics
import time

from offline_throughput import prefill_all

SCHEMA = {
    "type": "object",
    "required": ["items"],
    "properties": {
        "items": {
            "type": "array",
            "minItems": 200,
            "items": {
                "type": "object",
                "required": ["name", "qty"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[a-z]{3,12}$"},
                    "qty": {"type": "integer"},
                },
            },
        }
    },
}


def step_times(llm, batch: int, steps: int, constrained: bool) -> list[float]:
    from engine import GrammarSpec, SamplingParams
    from engine.messages.request import Request

    engine = llm.engine
    prompt = llm.apply_chat_template([{"role": "user", "content": "List items as JSON."}])
    spec = GrammarSpec("json", SCHEMA) if constrained else None
    for i in range(batch):
        params = SamplingParams(
            temperature=0.8, seed=i, max_tokens=steps + 8, ignore_eos=True, structured_outputs=spec
        )
        engine.add_request(Request(f"b{batch}-{constrained}-{i}", prompt, params))
    prefill_all(engine, batch)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort([f"b{batch}-{constrained}-{i}" for i in range(batch)])
    return times


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    from engine import LLM

    llm = LLM(dtype=args.dtype, structured_outputs_backend="xgrammar")
    print(f"decode step time, median of {args.steps} steps ({args.dtype})")
    print(
        f"{'batch':>6} {'unconstrained ms':>17} {'json schema ms':>15} {'overhead ms':>12} {'overhead %':>11}"
    )
    for batch in (1, 32):
        step_times(llm, batch, 5, True)  # warm-up and compile
        plain = statistics.median(step_times(llm, batch, args.steps, False))
        masked = statistics.median(step_times(llm, batch, args.steps, True))
        print(
            f"{batch:>6} {plain * 1000:>17.2f} {masked * 1000:>15.2f} {(masked - plain) * 1000:>12.2f} "
            f"{(masked / plain - 1) * 100:>10.1f}%"
        )


if __name__ == "__main__":
    main()
