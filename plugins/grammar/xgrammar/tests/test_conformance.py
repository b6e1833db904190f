"""grammar-xgrammar against the core's grammar contract, and its compile cache."""

import time

from engine.interfaces import GrammarContext, GrammarSpec
from engine.testing.grammar import GrammarBackendContract
from engine_grammar_xgrammar.backend import XGrammarBackend


class TestXGrammar(GrammarBackendContract):
    backend_name = "xgrammar"

    def test_any_json_accepts_json_and_refuses_the_rest(self, backend, tokenizer):
        grammar = backend.compile(GrammarSpec("json_object", None))
        assert grammar.accept_tokens(tokenizer.encode('{"a": [1, 2.5, "x"]}') + [tokenizer.eos_token_id])
        assert grammar.is_terminated()
        assert not backend.compile(GrammarSpec("json_object", None)).accept_tokens(tokenizer.encode("hello"))

    def test_compiled_grammars_are_cached_by_spec(self, tokenizer):
        backend = XGrammarBackend(GrammarContext(tokenizer, len(tokenizer)))
        nested = {"type": "object", "properties": {f"k{i}": {"type": "object", "properties": {
            f"j{j}": {"type": "string", "pattern": "[a-z]{2,9}"} for j in range(10)}} for i in range(10)}}
        started = time.perf_counter()
        backend.compile(GrammarSpec("json", nested))
        first = time.perf_counter() - started
        started = time.perf_counter()
        backend.compile(GrammarSpec("json", dict(nested)))
        assert time.perf_counter() - started < first / 5
