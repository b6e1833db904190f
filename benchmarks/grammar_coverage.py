"""JSON-schema coverage of the grammar backends, JSONSchemaBench-style: which schemas each
backend compiles, and how long a compile (with its first mask) takes.

    python benchmarks/grammar_coverage.py [--schemas FILE.json] [--backends xgrammar llguidance]
                                          [--tokenizer default|tiny] [--repeats 3] [--verbose]

Each schema of ``--schemas`` (a JSON object, name -> schema; default: the llguidance
plugin's ``tests/data/schemas.json``, 56 schemas from flat objects to ``$ref`` recursion,
formats, ``if``/``then``, ``uniqueItems``) is compiled by each backend through the registry
as the engine compiles it, ``--repeats`` times, each by a new backend instance (cold: no
cache hits; the fastest time counts, the machine being shared), on the default model's
tokenizer (49,152 tokens; ``--tokenizer tiny``: the grammar kit's byte-level one). A compile
that raises ValueError is a refusal. Printed: per backend the success rate and the mean and
median time of the schemas it compiled (compile and the first mask: llguidance does much of
its work lazily, at the first mask), then ``auto`` (the first backend that compiles each
schema: the union) and the schemas some backend refuses, with the reason (``--verbose``:
every refusal in full).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.interfaces import GrammarContext, GrammarSpec
from engine.plugins import load_plugins

SCHEMAS = Path(__file__).resolve().parents[1] / "plugins/grammar/llguidance/tests/data/schemas.json"


def tokenizer_of(kind: str):
    if kind == "tiny":
        from engine.testing.tiny_tokenizer import tiny_tokenizer

        tokenizer = tiny_tokenizer()
        return tokenizer, len(tokenizer)
    from engine import load_tokenizer

    _, tokenizer = load_tokenizer()
    return tokenizer, len(tokenizer)


def measure(backend, schemas: dict, vocab_size: int) -> dict[str, float | str]:
    """name -> seconds to compile and fill the first mask (llguidance builds lazily: compile
    alone would flatter it), or the refusal's reason."""
    results: dict[str, float | str] = {}
    mask = torch.full((1, -(-vocab_size // 32)), -1, dtype=torch.int32)
    for name, schema in schemas.items():
        started = time.perf_counter()
        try:
            backend.compile(GrammarSpec("json", schema)).fill_bitmask(mask, 0)
        except ValueError as exc:
            results[name] = str(exc).splitlines()[0]
            continue
        results[name] = time.perf_counter() - started
    return results


def _best(outcomes) -> float | str:
    """The fastest of a schema's runs (a refusal is the same in each)."""
    outcomes = list(outcomes)
    return min(outcomes) if isinstance(outcomes[0], float) else outcomes[0]


def summary(label: str, results: dict[str, float | str]) -> str:
    times = [t for t in results.values() if isinstance(t, float)]
    mean = f"{statistics.mean(times) * 1e3:8.1f}" if times else "       -"
    median = f"{statistics.median(times) * 1e3:8.1f}" if times else "       -"
    rate = f"{len(times):>3}/{len(results):<3} ({len(times) / len(results):6.1%})"
    return f"| {label:<11} | {rate} | {mean} | {median} |"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schemas", type=Path, default=SCHEMAS, help="JSON object of name -> schema")
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"], help="in auto's order")
    parser.add_argument("--tokenizer", choices=("default", "tiny"), default="default")
    parser.add_argument(
        "--repeats", type=int, default=3, help="cold runs per backend (new instances); the fastest counts"
    )
    parser.add_argument("--verbose", action="store_true", help="print every refusal in full")
    args = parser.parse_args()

    schemas = json.loads(args.schemas.read_text())
    tokenizer, vocab_size = tokenizer_of(args.tokenizer)
    registry = load_plugins()
    results = {}
    for name in args.backends:
        backend_cls = registry.get("grammar_backends", name)
        runs = [
            measure(backend_cls(GrammarContext(tokenizer, vocab_size)), schemas, vocab_size)
            for _ in range(args.repeats)
        ]
        results[name] = {schema: _best(run[schema] for run in runs) for schema in schemas}
    auto = {
        schema: next((r[schema] for r in results.values() if isinstance(r[schema], float)), "refused by all")
        for schema in schemas
    }
    print(
        f"{len(schemas)} schemas from {args.schemas.name}, tokenizer {args.tokenizer} ({vocab_size} tokens)"
    )
    print("| backend     | compiled          | mean ms  | median ms |  (compile + first mask)")
    print("|---|---|---:|---:|")
    for name, result in results.items():
        print(summary(name, result))
    print(summary("auto", auto))
    print("\nrefused:")
    for schema in schemas:
        refusals = {name: r[schema] for name, r in results.items() if isinstance(r[schema], str)}
        if refusals:
            text = "; ".join(
                f"{n}: {reason if args.verbose else reason[:90]}" for n, reason in refusals.items()
            )
            print(f"  {schema}: {text}")


if __name__ == "__main__":
    main()
