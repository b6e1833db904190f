"""grammar-llguidance against the core's grammar contract (on the kit's tiny tokenizer: no model
needed), its compile cache, and what it reads beyond the contract (Lark grammars)."""

import pytest

from engine.interfaces import GrammarContext, GrammarSpec
from engine.testing.grammar import GrammarBackendContract
from engine_grammar_llguidance.backend import CACHE_SIZE, LLGuidanceBackend

LARK = 'start: "(" DIGIT DIGIT? ")"\nDIGIT: /[0-9]/'


class TestLLGuidance(GrammarBackendContract):
    backend_name = "llguidance"

    def test_compiled_grammars_are_cached_by_spec(self, tokenizer, vocab_size):
        """Equal specs (a dict in any key order, or its copy) compile once; the least recently
        used falls out past CACHE_SIZE. (llguidance compiles lazily, in about a millisecond
        here, so the cache is checked by its entries, not by the time a compile saves.)"""
        backend = LLGuidanceBackend(GrammarContext(tokenizer, vocab_size))
        schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
        backend.compile(GrammarSpec("json", schema))
        backend.compile(GrammarSpec("json", dict(reversed(schema.items()))))
        assert len(backend._cache) == 1
        for i in range(CACHE_SIZE):
            backend.compile(GrammarSpec("choice", [f"c{i}"]))
        assert len(backend._cache) == CACHE_SIZE
        assert not any('"json"' in key for key in backend._cache), "the oldest entry must go first"

    def test_lark_grammars_are_read_as_lark(self, backend, tokenizer):
        eos = tokenizer.eos_token_id
        for text, ok in [("(7)", True), ("(42)", True), ("(123)", False), ("()", False)]:
            grammar = backend.compile(GrammarSpec("grammar", LARK))
            assert grammar.accept_tokens(tokenizer.encode(text) + [eos]) is ok, text

    def test_regex_classes_are_ascii_as_in_json_schema(self, backend, tokenizer):
        """``\\d`` is [0-9] in ECMAScript (JSON Schema's dialect), not every Unicode digit."""
        eos = tokenizer.eos_token_id
        assert backend.compile(GrammarSpec("regex", r"\d\w")).accept_tokens(tokenizer.encode("7x") + [eos])
        assert not backend.compile(GrammarSpec("regex", r"\d")).accept_tokens(tokenizer.encode("٣") + [eos])
        assert not backend.compile(GrammarSpec("regex", r"\w")).accept_tokens(tokenizer.encode("é") + [eos])

    def test_the_true_schema_is_any_json_value(self, backend, tokenizer):
        eos = tokenizer.eos_token_id
        for text in ['{"a": [1]}', "[true, null]", '"text"', "12"]:
            assert backend.compile(GrammarSpec("json", True)).accept_tokens(tokenizer.encode(text) + [eos]), (
                text
            )

    @pytest.mark.parametrize(
        "spec",
        [
            GrammarSpec("json", "{not json"),
            GrammarSpec("json", [1]),
            GrammarSpec("regex", 5),
            GrammarSpec("choice", ["a", ""]),
            GrammarSpec("grammar", "start: undefined_rule"),
        ],
        ids=["schema-text", "schema-list", "regex-type", "empty-choice", "lark-undefined"],
    )
    def test_more_invalid_specs_raise_value_error(self, backend, spec):
        with pytest.raises(ValueError, match=r"\S"):
            backend.compile(spec)
