"""grammar-xgrammar against the core's grammar contract (on the kit's tiny tokenizer: no model
needed), and its compile cache."""

import time

from engine.interfaces import GrammarContext, GrammarSpec
from engine.testing.grammar import GrammarBackendContract
from engine_grammar_xgrammar.backend import XGrammarBackend


class TestXGrammar(GrammarBackendContract):
    backend_name = "xgrammar"

    def test_compiled_grammars_are_cached_by_spec(self, tokenizer, vocab_size):
        backend = XGrammarBackend(GrammarContext(tokenizer, vocab_size))
        nested = {
            "type": "object",
            "properties": {
                f"k{i}": {
                    "type": "object",
                    "properties": {f"j{j}": {"type": "string", "pattern": "[a-z]{2,9}"} for j in range(10)},
                }
                for i in range(10)
            },
        }
        started = time.perf_counter()
        backend.compile(GrammarSpec("json", nested))
        first = time.perf_counter() - started
        started = time.perf_counter()
        backend.compile(GrammarSpec("json", dict(nested)))
        assert time.perf_counter() - started < first / 5
