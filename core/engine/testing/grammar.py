"""Grammar backend contract, on the engine's own mask conventions: each bitmask row starts
all-allowed (-1 words) and is ``ceil(vocab_size / 32)`` words wide, ``vocab_size`` being the
model's logits width, larger than the tokenizer (padding ids no grammar may allow).

By default it runs on the kit's tiny byte-level tokenizer (:mod:`engine.testing.tiny_tokenizer`)
with 45 padding ids, so it needs no model; override the ``tokenizer`` and ``vocab_size``
fixtures to run it on a model's. It checks what :mod:`engine.interfaces.grammar` promises:
random walks that pick any token the mask allows end, at EOS, in output the spec accepts (JSON
in ``json.dumps``'s layout, ``json_object`` an object); a longer match stays reachable after a
shorter one could end; ``is_terminated`` turns true exactly at EOS; rollback (past EOS too),
``reset``, refusal without change, independent grammars per compile, ValueError for bad specs,
reasons for unsupported kinds; structural tags (v3) give free text with valid tagged JSON."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.interfaces import GrammarContext, GrammarSpec
from engine.interfaces.grammar import KIND_SINCE
from engine.plugins import load_plugins
from engine.testing.tiny_tokenizer import tiny_tokenizer

PADDING_IDS = 45  # more than a whole 32-bit word past the tokenizer, the last word partly used
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "n", "tags"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
    },
}
CHOICES = ["red", "green", "deep", "deep blue sea"]  # "deep" may end, or go on to "deep blue sea"
REGEX = r"[a-c]{2,5}-\d{2}"
OPTIONAL_TAIL = r"deep( blue sea)?"
EBNF = 'root ::= "(" [0-9] [0-9]? ")"'
JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _valid_json(text: str) -> bool:
    import jsonschema

    jsonschema.validate(json.loads(text), SCHEMA)
    return True


def json_layout_ok(text: str) -> bool:
    """``json.dumps``'s default layout: outside strings, one space after each ``,`` and ``:``
    and no other whitespace (the JSON kinds' documented layout)."""
    skeleton = JSON_STRING.sub('""', text)
    return not re.search(r"[,:](?! )", skeleton) and not re.search(r"\s", re.sub(r"(?<=[,:]) ", "", skeleton))


CASES = {
    "json": (GrammarSpec("json", SCHEMA), lambda t: _valid_json(t) and json_layout_ok(t)),
    "json_object": (
        GrammarSpec("json_object", None),
        lambda t: isinstance(json.loads(t), dict) and json_layout_ok(t),
    ),
    "regex": (GrammarSpec("regex", REGEX), lambda t: re.fullmatch(REGEX, t)),
    "grammar": (GrammarSpec("grammar", EBNF), lambda t: re.fullmatch(r"\(\d\d?\)", t)),
    "choice": (GrammarSpec("choice", CHOICES), lambda t: t in CHOICES),
}
BAD = {
    "json": GrammarSpec("json", {"type": "no-such-type"}),
    "regex": GrammarSpec("regex", "([a-z"),
    "grammar": GrammarSpec("grammar", "root ::= ???"),
    "choice": GrammarSpec("choice", []),
}
# spec, a text that may end early, and the longer text it must still be able to become
LONGER = {
    "choice": (GrammarSpec("choice", CHOICES), "deep", "deep blue sea"),
    "regex": (GrammarSpec("regex", OPTIONAL_TAIL), "deep", "deep blue sea"),
}
NOT_OBJECTS = ["[1, 2]", '"text"', "12", "true", "null"]
# free text, and a <tool>...</tool> tag holding JSON under SCHEMA wherever "<tool" appears
STRUCTURAL_TAG = GrammarSpec(
    "structural_tag",
    {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<tool"],
            "tags": [
                {
                    "type": "tag",
                    "begin": "<tool>",
                    "content": {"type": "json_schema", "json_schema": SCHEMA},
                    "end": "</tool>",
                }
            ],
        },
    },
)
TWO_TAGS_TAIL = '<tool>{"name": "c", "n": 0, "tags": []}</tool>'
TAGGED = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)


def tagged_json_ok(text: str) -> bool:
    """Every ``<tool`` in ``text`` opens a ``<tool>...</tool>`` tag holding JSON valid under
    SCHEMA, in ``json.dumps``'s layout."""
    tags = TAGGED.findall(text)
    return text.count("<tool") == len(tags) and all(_valid_json(tag) and json_layout_ok(tag) for tag in tags)


def engine_row(grammar, vocab_size: int) -> torch.Tensor:
    """``grammar``'s mask as the engine asks for it: row 1 of three all-allowed rows (-1 words),
    ``ceil(vocab_size / 32)`` words wide. The rows around it must stay untouched."""
    mask = torch.full((3, -(-vocab_size // 32)), -1, dtype=torch.int32)
    grammar.fill_bitmask(mask, 1)
    assert (mask[0] == -1).all() and (mask[2] == -1).all(), "fill_bitmask wrote outside its row"
    return mask[1].clone()


def allowed_ids(row: torch.Tensor, vocab_size: int) -> list[int]:
    bits = (row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


class GrammarBackendContract:
    backend_name: str

    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls):
        return tiny_tokenizer()

    @pytest.fixture(scope="class")
    @classmethod
    def vocab_size(cls, tokenizer):
        """The model's logits width (``GrammarContext.vocab_size``): padded past the tokenizer."""
        return len(tokenizer) + PADDING_IDS

    @pytest.fixture(scope="class")
    @classmethod
    def closing(cls, tokenizer) -> set[int]:
        """EOS and the tokens that close a string or a bracket: what random walks lean to."""
        return {
            t
            for t in range(len(tokenizer))
            if t == tokenizer.eos_token_id or tokenizer.decode([t]).endswith(('"', "}", "]", ")"))
        }

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls, tokenizer, vocab_size):
        backend_cls = load_plugins().get("grammar_backends", cls.backend_name)
        return backend_cls(GrammarContext(tokenizer, vocab_size))

    def _supported(self, backend, spec: GrammarSpec) -> GrammarSpec:
        api = load_plugins().registration("grammar_backends", self.backend_name).api
        if api < KIND_SINCE.get(spec.kind, 0):
            pytest.skip(f"{self.backend_name} targets grammar interface v{api}, before {spec.kind}")
        if backend.supports(spec):
            pytest.skip(f"{self.backend_name} does not compile {spec.kind}")
        return spec

    def _allowed(self, grammar, tokenizer, vocab_size) -> list[int]:
        """The ids the grammar allows now, checked to be tokens of the tokenizer."""
        allowed = allowed_ids(engine_row(grammar, vocab_size), vocab_size)
        assert allowed, "a live grammar must allow some token (at least EOS once it may end)"
        padding = [t for t in allowed if t >= len(tokenizer)]
        assert not padding, (
            f"padding ids {padding[:5]} are allowed: fill_bitmask must write every word of its "
            f"row (the engine's rows start all-allowed, -1) over the model's vocabulary "
            f"(GrammarContext.vocab_size={vocab_size}), not the tokenizer's {len(tokenizer)}"
        )
        return allowed

    def _accept(self, grammar, token: int, eos: int) -> None:
        assert grammar.accept_tokens([token]), f"token {token} was allowed by the mask but refused"
        if token == eos:
            assert grammar.is_terminated(), "is_terminated() must be True once EOS is accepted"
        else:
            assert not grammar.is_terminated(), "is_terminated() must stay False until EOS is accepted"

    def _walk(self, grammar, tokenizer, vocab_size, closing, rng) -> list[int]:
        """Pick allowed tokens at random until EOS, leaning to EOS and to tokens that close a
        string or a bracket half the time, so that free JSON ends in reasonable length."""
        eos, tokens = tokenizer.eos_token_id, []
        for _ in range(300):
            allowed = self._allowed(grammar, tokenizer, vocab_size)
            closers = [t for t in allowed if t in closing]
            token = rng.choice(closers if closers and rng.random() < 0.5 else allowed)
            self._accept(grammar, token, eos)
            tokens.append(token)
            if token == eos:
                return tokens
        pytest.fail("the walk did not reach EOS in 300 tokens")

    def _force(self, grammar, tokenizer, vocab_size, text: str) -> None:
        """Walk the tokens of ``text``, each of which the mask must allow."""
        for token in tokenizer.encode(text):
            assert token in self._allowed(grammar, tokenizer, vocab_size), (
                f"{text!r}: token {token} not allowed"
            )
            self._accept(grammar, token, tokenizer.eos_token_id)

    @pytest.mark.parametrize("kind", sorted(CASES))
    def test_random_walks_produce_valid_output(self, backend, tokenizer, vocab_size, closing, kind):
        spec, check = self._supported(backend, CASES[kind][0]), CASES[kind][1]
        rng = random.Random(0)
        with ThreadPoolExecutor(1) as pool:  # the engine compiles on a worker thread
            grammars = [pool.submit(backend.compile, spec).result() for _ in range(8)]
        for grammar in grammars:
            tokens = self._walk(grammar, tokenizer, vocab_size, closing, rng)
            text = tokenizer.decode(tokens[:-1])
            assert check(text), f"{kind}: {text!r} violates {spec.value!r}"

    def test_fill_bitmask_writes_the_whole_row(self, backend, tokenizer, vocab_size):
        """The engine's rows start all-allowed: a backend that only sets bits allows everything."""
        grammar = backend.compile(self._supported(backend, CASES["choice"][0]))
        words = -(-vocab_size // 32)
        for token in [*tokenizer.encode("deep"), None]:
            rows = torch.stack(
                [
                    torch.full((words,), -1, dtype=torch.int32),
                    torch.zeros(words, dtype=torch.int32),
                    torch.randint(-(2**31), 2**31, (words,), dtype=torch.int32),
                ]
            )
            for row in range(3):
                grammar.fill_bitmask(rows, row)
            first, *others = (allowed_ids(row, vocab_size) for row in rows)
            assert all(ids == first for ids in others), (
                "fill_bitmask must overwrite every word of its row, whatever the row held"
            )
            if token is not None:
                assert grammar.accept_tokens([token])

    @pytest.mark.parametrize("kind", sorted(LONGER))
    def test_longer_matches_stay_reachable(self, backend, tokenizer, vocab_size, kind):
        """Where the output may end, the mask allows EOS and the way on; only EOS ends it."""
        spec, short, longer = LONGER[kind]
        grammar = backend.compile(self._supported(backend, spec))
        self._force(grammar, tokenizer, vocab_size, short)
        allowed = self._allowed(grammar, tokenizer, vocab_size)
        assert tokenizer.eos_token_id in allowed, f"EOS not allowed after {short!r}, a complete match"
        self._force(grammar, tokenizer, vocab_size, longer[len(short) :])
        self._accept(grammar, tokenizer.eos_token_id, tokenizer.eos_token_id)

    def test_json_object_is_an_object(self, backend, tokenizer):
        spec = self._supported(backend, CASES["json_object"][0])
        eos = tokenizer.eos_token_id
        text = '{"a": [1, 2.5, "x"], "b": {"c": null}}'
        grammar = backend.compile(spec)
        assert grammar.accept_tokens(tokenizer.encode(text) + [eos]), f"{text!r} refused"
        assert grammar.is_terminated()
        for text in NOT_OBJECTS:
            assert not backend.compile(spec).accept_tokens(tokenizer.encode(text) + [eos]), (
                f"json_object accepted {text!r}: it means a JSON object, as OpenAI's response_format"
            )

    def test_json_layout_is_json_dumps(self, backend, tokenizer):
        spec = self._supported(backend, CASES["json_object"][0])
        eos = tokenizer.eos_token_id
        assert backend.compile(spec).accept_tokens(tokenizer.encode('{"a": 1, "b": [2, 3]}') + [eos])
        for text in ['{"a":1}', '{ "a": 1}', '{"a": 1,"b": 2}', '{"a": 1}\n']:
            assert not backend.compile(spec).accept_tokens(tokenizer.encode(text) + [eos]), (
                f"{text!r} accepted: JSON takes json.dumps's layout, no other whitespace"
            )

    def test_rollback_restores_the_mask_also_past_eos(self, backend, tokenizer, vocab_size):
        grammar = backend.compile(self._supported(backend, CASES["choice"][0]))
        start = engine_row(grammar, vocab_size)
        tokens = tokenizer.encode("red")
        self._force(grammar, tokenizer, vocab_size, "red")
        after = engine_row(grammar, vocab_size)
        self._accept(grammar, tokenizer.eos_token_id, tokenizer.eos_token_id)
        grammar.rollback(1)
        assert not grammar.is_terminated(), "rolling EOS back must un-terminate the grammar"
        assert torch.equal(after, engine_row(grammar, vocab_size))
        grammar.rollback(len(tokens))
        assert torch.equal(start, engine_row(grammar, vocab_size))
        self._force(grammar, tokenizer, vocab_size, "deep blue sea")

    def test_rollback_of_eos_where_the_output_could_go_on(self, backend, tokenizer, vocab_size):
        """EOS after "deep" (which may end or become "deep blue sea") rolls back like any token:
        a backend whose library records EOS only in some states must count it in each."""
        grammar = backend.compile(self._supported(backend, CASES["choice"][0]))
        self._force(grammar, tokenizer, vocab_size, "deep")
        open_end = engine_row(grammar, vocab_size)
        self._accept(grammar, tokenizer.eos_token_id, tokenizer.eos_token_id)
        grammar.rollback(1)
        assert not grammar.is_terminated(), "rolling EOS back must un-terminate the grammar"
        assert torch.equal(open_end, engine_row(grammar, vocab_size)), "rollback(1) past EOS changed the mask"
        self._force(grammar, tokenizer, vocab_size, " blue sea")
        self._accept(grammar, tokenizer.eos_token_id, tokenizer.eos_token_id)

    def test_tokens_after_eos_are_refused(self, backend, tokenizer):
        grammar = backend.compile(self._supported(backend, CASES["choice"][0]))
        assert grammar.accept_tokens(tokenizer.encode("red") + [tokenizer.eos_token_id])
        for token in [tokenizer.eos_token_id, *tokenizer.encode(" blue")]:
            assert not grammar.accept_tokens([token])
        assert grammar.is_terminated()

    def test_reset_returns_to_the_start(self, backend, tokenizer, vocab_size):
        grammar = backend.compile(self._supported(backend, CASES["choice"][0]))
        start = engine_row(grammar, vocab_size)
        self._force(grammar, tokenizer, vocab_size, "deep")
        grammar.reset()
        assert torch.equal(start, engine_row(grammar, vocab_size)), "reset must return to the first mask"
        assert grammar.accept_tokens(tokenizer.encode("red") + [tokenizer.eos_token_id])
        grammar.reset()
        assert not grammar.is_terminated(), "reset must undo termination"
        assert torch.equal(start, engine_row(grammar, vocab_size)), "reset must return to the first mask"
        self._force(grammar, tokenizer, vocab_size, "green")

    def test_disallowed_tokens_are_refused_without_change(self, backend, tokenizer, vocab_size):
        grammar = backend.compile(self._supported(backend, CASES["choice"][0]))
        self._force(grammar, tokenizer, vocab_size, "deep")
        mask = engine_row(grammar, vocab_size)
        allowed = set(allowed_ids(mask, vocab_size))
        banned = next(t for t in tokenizer.encode(" purple zebra") if t not in allowed)
        for tokens in ([banned], [*tokenizer.encode(" blue"), banned]):
            assert not grammar.accept_tokens(tokens)
            assert torch.equal(mask, engine_row(grammar, vocab_size)), (
                f"refusing {tokens} changed the state: accept_tokens is all or nothing"
            )
        self._force(grammar, tokenizer, vocab_size, " blue sea")

    def test_each_compile_is_a_grammar_of_its_own(self, backend, tokenizer, vocab_size):
        """Requests with one spec (``n > 1`` children) each advance their own state."""
        spec = self._supported(backend, CASES["choice"][0])
        first, second = backend.compile(spec), backend.compile(spec)
        start = engine_row(second, vocab_size)
        self._force(first, tokenizer, vocab_size, "deep")
        assert torch.equal(start, engine_row(second, vocab_size))

    @pytest.mark.parametrize("kind", sorted(BAD))
    def test_invalid_specs_raise_value_error(self, backend, kind):
        self._supported(backend, BAD[kind])
        with pytest.raises(ValueError):
            backend.compile(BAD[kind])

    def test_structural_tag_walks_give_tagged_json(self, backend, tokenizer, vocab_size, closing):
        """Free text, the trigger: from there the mask holds the walk to the tag's JSON and its
        end, then the text is free again until EOS."""
        spec = self._supported(backend, STRUCTURAL_TAG)
        rng = random.Random(0)
        for _ in range(4):
            grammar = backend.compile(spec)
            self._force(grammar, tokenizer, vocab_size, "Calling it: <tool")
            tokens = self._walk(grammar, tokenizer, vocab_size, closing, rng)
            text = "Calling it: <tool" + tokenizer.decode(tokens[:-1])
            assert tagged_json_ok(text) and "</tool>" in text, f"{text!r} is not free text and tagged JSON"

    @pytest.mark.parametrize(
        ("text", "ok"),
        [
            ("any text at all, {not json} [1, 2 < 3", True),
            ('a <tool>{"name": "ab", "n": 3, "tags": []}</tool> then <tool>', False),
            (
                '<tool>{"name": "ab", "n": 3, "tags": ["red"]}</tool> b ' + TWO_TAGS_TAIL,
                True,
            ),
            ('a <tool>{"name": "ab", "n": 300, "tags": []}</tool>', False),
            ("a <tooling>", False),
        ],
    )
    def test_structural_tag_frees_text_and_holds_tags(self, backend, tokenizer, text, ok):
        grammar = backend.compile(self._supported(backend, STRUCTURAL_TAG))
        assert grammar.accept_tokens(tokenizer.encode(text) + [tokenizer.eos_token_id]) is ok, text

    def test_invalid_structural_tag_raises_value_error(self, backend):
        bad = GrammarSpec(
            "structural_tag",
            {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<x"], "tags": []}},
        )
        self._supported(backend, STRUCTURAL_TAG)
        with pytest.raises(ValueError):
            backend.compile(bad)

    def test_unsupported_kind_gives_reasons(self, backend):
        reasons = backend.supports(GrammarSpec("bogus", None))
        assert reasons and all(isinstance(r, str) and r for r in reasons)
