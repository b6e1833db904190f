"""JSON-schema and structural-tag coverage of the grammar backends, JSONSchemaBench-style:
which specs each backend compiles, and how long a compile (with its first mask) takes.

    python benchmarks/grammar_coverage.py [--schemas FILE.json] [--corpora json structural_tag]
                                          [--backends xgrammar llguidance]
                                          [--tokenizer default|tiny] [--repeats 3] [--verbose]

Two corpora: ``json``, each schema of ``--schemas`` (a JSON object, name -> schema; default:
the llguidance plugin's ``tests/data/schemas.json``, 56 schemas from flat objects to ``$ref``
recursion, formats, ``if``/``then``, ``uniqueItems``), and ``structural_tag``, the tags
``structural_tag_corpus.py`` builds around those schemas in both of vLLM's shapes (read by
the server's own ``structural_tag_spec``, as a request's ``response_format`` is). Each spec
is compiled by each backend through the registry as the engine compiles it (``supports``,
then ``compile``), ``--repeats`` times, each by a new backend instance (cold: no cache hits;
the fastest time counts, the machine being shared), on the default model's tokenizer (49,152
tokens; ``--tokenizer tiny``: the grammar kit's byte-level one). A ``supports`` reason or a
compile that raises ValueError is a refusal. Printed per corpus: per backend the success rate
and the mean and median time of the specs it compiled (compile and the first mask: llguidance
does much of its work lazily, at the first mask), then ``auto`` (the first backend that
compiles each spec: the union) and the specs some backend refuses, with the reason
(``--verbose``: every refusal in full).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from structural_tag_corpus import structural_tags

from engine.interfaces import GrammarContext, GrammarSpec
from engine.plugins import load_plugins
from engine_server.structural_tags import structural_tag_spec

SCHEMAS = Path(__file__).resolve().parents[1] / "plugins/grammar/llguidance/tests/data/schemas.json"


def tokenizer_of(kind: str):
    if kind == "tiny":
        from engine.testing.tiny_tokenizer import tiny_tokenizer

        tokenizer = tiny_tokenizer()
        return tokenizer, len(tokenizer)
    from engine import load_tokenizer

    _, tokenizer = load_tokenizer()
    return tokenizer, len(tokenizer)


def corpus(kind: str, schemas: dict) -> dict[str, GrammarSpec]:
    """name -> the spec the engine gets: a schema as the ``json`` kind, a structural tag as
    the server turns a ``response_format`` into the ``structural_tag`` kind."""
    if kind == "json":
        return {name: GrammarSpec("json", schema) for name, schema in schemas.items()}
    return {
        name: structural_tag_spec(tag, "response_format", "response_format")
        for name, tag in structural_tags(schemas).items()
    }


def measure(backend, specs: dict[str, GrammarSpec], vocab_size: int) -> dict[str, float | str]:
    """name -> seconds to compile and fill the first mask (llguidance builds lazily: compile
    alone would flatter it), or the refusal's reason."""
    results: dict[str, float | str] = {}
    mask = torch.full((1, -(-vocab_size // 32)), -1, dtype=torch.int32)
    for name, spec in specs.items():
        started = time.perf_counter()
        reasons = backend.supports(spec)
        if reasons:
            results[name] = reasons[0]
            continue
        try:
            backend.compile(spec).fill_bitmask(mask, 0)
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
    parser.add_argument(
        "--corpora", nargs="+", choices=("json", "structural_tag"), default=["json", "structural_tag"]
    )
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
    for kind in args.corpora:
        specs = corpus(kind, schemas)
        print(
            f"\n{len(specs)} {kind} specs (schemas from {args.schemas.name}), "
            f"tokenizer {args.tokenizer} ({vocab_size} tokens)"
        )
        report(registry, args, specs, tokenizer, vocab_size)


def report(registry, args, specs: dict[str, GrammarSpec], tokenizer, vocab_size: int) -> None:
    """One corpus's table (each backend, then ``auto``) and its refusals."""
    results = {}
    for name in args.backends:
        backend_cls = registry.get("grammar_backends", name)
        runs = [
            measure(backend_cls(GrammarContext(tokenizer, vocab_size)), specs, vocab_size)
            for _ in range(args.repeats)
        ]
        results[name] = {spec: _best(run[spec] for run in runs) for spec in specs}
    auto = {
        spec: next((r[spec] for r in results.values() if isinstance(r[spec], float)), "refused by all")
        for spec in specs
    }
    print("| backend     | compiled          | mean ms  | median ms |  (compile + first mask)")
    print("|---|---|---:|---:|")
    for name, result in results.items():
        print(summary(name, result))
    print(summary("auto", auto))
    print("\nrefused:")
    for spec in specs:
        refusals = {name: r[spec] for name, r in results.items() if isinstance(r[spec], str)}
        if refusals:
            text = "; ".join(
                f"{n}: {reason if args.verbose else reason[:90]}" for n, reason in refusals.items()
            )
            print(f"  {spec}: {text}")


if __name__ == "__main__":
    main()
