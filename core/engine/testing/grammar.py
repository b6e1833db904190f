"""Grammar backend contract, on a real tokenizer (the default model's unless a subclass
overrides the ``tokenizer`` fixture): random walks that pick any token the bitmask allows
must end in output the spec accepts; rollback restores the mask; a disallowed token is
refused without changing state; a bad spec raises ValueError; unsupported kinds give
reasons."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from engine.interfaces import GrammarContext, GrammarSpec
from engine.plugins import load_plugins

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "tags"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3}}}


def _valid_json(text: str) -> bool:
    import jsonschema

    jsonschema.validate(json.loads(text), SCHEMA)
    return True


CASES = {
    "json": (GrammarSpec("json", SCHEMA), _valid_json),
    "regex": (GrammarSpec("regex", r"[a-c]{2,5}-\d{2}"), lambda t: re.fullmatch(r"[a-c]{2,5}-\d{2}", t)),
    "grammar": (GrammarSpec("grammar", 'root ::= "(" [0-9] [0-9]? ")"'), lambda t: re.fullmatch(r"\(\d\d?\)", t)),
    "choice": (GrammarSpec("choice", ["red", "green", "deep blue"]), lambda t: t in ("red", "green", "deep blue")),
}
BAD = {"json": GrammarSpec("json", {"type": "no-such-type"}), "regex": GrammarSpec("regex", "([a-z"),
       "grammar": GrammarSpec("grammar", "root ::= ???"), "choice": GrammarSpec("choice", [])}


def current_mask(grammar, vocab: int) -> torch.Tensor:
    mask = torch.zeros(1, -(-vocab // 32), dtype=torch.int32)
    grammar.fill_bitmask(mask, 0)
    return mask


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


class GrammarBackendContract:
    backend_name: str

    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls):
        from engine import load_tokenizer

        try:
            return load_tokenizer()[1]
        except ValueError as exc:
            pytest.skip(f"no default model for the tokenizer: {exc}")

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls, tokenizer):
        backend_cls = load_plugins().get("grammar_backends", cls.backend_name)
        return backend_cls(GrammarContext(tokenizer, len(tokenizer)))

    def _supported(self, backend, kind):
        spec = CASES[kind][0]
        if backend.supports(spec):
            pytest.skip(f"{self.backend_name} does not compile {kind}")
        return spec

    def _walk(self, grammar, tokenizer, rng) -> list[int]:
        vocab = len(tokenizer)
        tokens = []
        for _ in range(200):
            allowed = allowed_tokens(current_mask(grammar, vocab), vocab)
            assert allowed, "a live grammar must allow some token"
            token = rng.choice(allowed)
            assert grammar.accept_tokens([token])
            tokens.append(token)
            if grammar.is_terminated():
                return tokens
        pytest.fail("the walk did not terminate in 200 tokens")

    @pytest.mark.parametrize("kind", sorted(CASES))
    def test_random_walks_produce_valid_output(self, backend, tokenizer, kind):
        spec = self._supported(backend, kind)
        check = CASES[kind][1]
        rng = random.Random(0)
        for _ in range(8):
            tokens = self._walk(backend.compile(spec), tokenizer, rng)
            text = tokenizer.decode([t for t in tokens if t != tokenizer.eos_token_id], skip_special_tokens=True)
            assert check(text), f"{kind}: {text!r} violates {spec.value!r}"

    def test_rollback_restores_the_mask(self, backend, tokenizer):
        spec = self._supported(backend, "choice")
        grammar = backend.compile(spec)
        before = current_mask(grammar, len(tokenizer))
        assert grammar.accept_tokens([tokenizer.encode("deep")[0]])
        grammar.rollback(1)
        assert torch.equal(before, current_mask(grammar, len(tokenizer)))

    def test_disallowed_token_is_refused(self, backend, tokenizer):
        spec = self._supported(backend, "choice")
        grammar = backend.compile(spec)
        mask = current_mask(grammar, len(tokenizer))
        allowed = set(allowed_tokens(mask, len(tokenizer)))
        banned = next(t for t in tokenizer.encode(" purple zebra") if t not in allowed)
        assert not grammar.accept_tokens([banned])
        assert torch.equal(mask, current_mask(grammar, len(tokenizer)))

    @pytest.mark.parametrize("kind", sorted(BAD))
    def test_invalid_specs_raise_value_error(self, backend, kind):
        self._supported(backend, kind)
        with pytest.raises(ValueError):
            backend.compile(BAD[kind])

    def test_unsupported_kind_gives_reasons(self, backend):
        reasons = backend.supports(GrammarSpec("bogus", None))
        assert reasons and all(isinstance(r, str) and r for r in reasons)
