"""grammar-xgrammar against the core's grammar contract (on the kit's tiny tokenizer: no model
needed), and its compile cache."""

import time

import pytest

from engine.interfaces import GrammarContext, GrammarSpec
from engine.testing.grammar import GrammarBackendContract
from engine_grammar_xgrammar.backend import XGrammarBackend, ignored_keywords


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

    @pytest.mark.parametrize(
        "schema, keyword",
        [
            ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
            ({"properties": {"a": {"not": {"type": "string"}}}}, "not"),
            ({"anyOf": [{"if": {"const": 1}, "then": {"const": 1}}]}, "if"),
            ({"$defs": {"d": {"dependentRequired": {"a": ["b"]}}}}, "dependentRequired"),
            ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
        ],
    )
    def test_keywords_it_would_not_enforce_are_refused(self, backend, schema, keyword):
        """xgrammar compiles these by ignoring them; a grammar looser than the schema is refused."""
        with pytest.raises(ValueError, match=keyword):
            backend.compile(GrammarSpec("json", schema))

    def test_keyword_names_as_property_names_are_fine(self, backend, tokenizer):
        schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "boolean"}}}
        grammar = backend.compile(GrammarSpec("json", schema))
        assert grammar.accept_tokens(tokenizer.encode('{"not": 1, "if": true}') + [tokenizer.eos_token_id])
        assert not ignored_keywords({"type": "integer", "multipleOf": 5, "uniqueItems": False})
