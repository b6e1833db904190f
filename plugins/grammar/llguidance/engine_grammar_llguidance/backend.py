"""llguidance behind the GrammarBackend interface.

Every kind becomes one llguidance grammar (``LLMatcher.grammar_from_*``), compiled into an
``LLMatcher`` against the tokenizer's ``LLTokenizer``; that is built once per (tokenizer,
vocabulary size) and shared, and its vocabulary is the model's logits width, so the
matcher's mask is exactly the engine's row (padding ids are tokens of no bytes, never
allowed). Compiled matchers are cached by spec (an LRU of ``CACHE_SIZE``) and each compile
hands out a ``deep_copy``: ``n > 1`` children and repeated schemas compile once.

- ``json`` / ``json_object``: llguidance's JSON compiler in ``json.dumps``'s layout
  (``", "`` and ``": "``, no free whitespace); ``json_object`` is the schema
  ``{"type": "object"}``. Keywords llguidance does not implement are refused, not ignored
  (never looser than the schema).
- ``regex``: JSON Schema's ECMAScript dialect, so ``\\d`` and ``\\w`` are ASCII (llguidance's
  own regexes are Rust's, where they are Unicode), matched in full.
- ``grammar``: GBNF, converted by llguidance's own converter; a grammar in Lark syntax
  (``start: ...``), as vLLM's ``guided_grammar`` also takes it, is read as Lark.
- ``choice``: a Lark alternation of the strings as JSON string literals.
- ``structural_tag``: a Lark grammar with lazy trigger lexemes
  (:mod:`engine_grammar_llguidance.structural_tag`, which says the formats it reads).

A matcher that consumes a token it does not allow enters an error state for good, so
``accept_tokens`` validates all its tokens first and consumes only when all pass.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance as llg
import llguidance.hf
import llguidance.torch
from llguidance.gbnf_to_lark import any_to_lark

from engine.interfaces import Grammar, GrammarBackend, GrammarSpec
from engine_grammar_llguidance import structural_tag

CACHE_SIZE = 256
KINDS = ("json", "json_object", "regex", "grammar", "choice", "structural_tag")
ANY_OBJECT = {"type": "object"}
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ECMASCRIPT_ASCII = "dw"  # regex_to_lark: \d and \w as JSON Schema's patterns read them
_tokenizers: dict[tuple, llg.LLTokenizer] = {}
_tokenizers_lock = threading.Lock()


def ll_tokenizer(tokenizer, vocab_size: int) -> llg.LLTokenizer:
    """The tokenizer as llguidance reads it, over the model's vocabulary (built once, shared)."""
    key = (getattr(tokenizer, "name_or_path", ""), len(tokenizer), vocab_size, id(tokenizer))
    with _tokenizers_lock:
        if key not in _tokenizers:
            if len(tokenizer) > vocab_size:
                raise ValueError(
                    f"the tokenizer has {len(tokenizer)} tokens, more than the model's "
                    f"{vocab_size} logits: llguidance masks cover the tokenizer"
                )
            _tokenizers[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        return _tokenizers[key]


class LLGuidanceGrammar(Grammar):
    def __init__(self, matcher: llg.LLMatcher, eos: int):
        self.matcher = matcher
        self.eos = eos
        self.terminated = False  # the last accepted token is EOS (nothing is accepted after it)
        # EOS accepted where the grammar had already stopped (only EOS could follow): llguidance
        # keeps no history entry for it, so rolling it back is rolling back nothing
        self.eos_unrecorded = False

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if not token_ids:
            return True
        if not self._valid(token_ids):
            return False
        for token in token_ids:  # one by one: consume_tokens refuses EOS once the grammar is at its end
            self.eos_unrecorded = token == self.eos and self.matcher.is_stopped()
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused a token it validated: {self.matcher.get_error()}")
        self.terminated = token_ids[-1] == self.eos
        return True

    def _valid(self, token_ids: list[int]) -> bool:
        """Whether all of ``token_ids`` may come next. A matcher stopped at the end of its
        grammar (only EOS may follow) validates no token, EOS included, yet consumes EOS."""
        if self.terminated:
            return False
        if self.matcher.is_stopped():
            return token_ids == [self.eos]
        return self.matcher.validate_tokens(token_ids) == len(token_ids)

    def fill_bitmask(self, bitmask, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            recorded = num_tokens - (self.terminated and self.eos_unrecorded)
            if recorded:
                self.matcher.rollback(recorded)
            self.terminated = self.eos_unrecorded = False

    def is_terminated(self) -> bool:
        return self.terminated

    def reset(self) -> None:
        self.matcher.reset()
        self.terminated = self.eos_unrecorded = False


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, ctx):
        super().__init__(ctx)
        if ctx.tokenizer is None:
            raise ValueError("structured outputs with llguidance need the model's tokenizer")
        self.tokenizer = ll_tokenizer(ctx.tokenizer, ctx.vocab_size)
        self.eos = ctx.tokenizer.eos_token_id
        self._cache: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def supports(cls, spec: GrammarSpec) -> list[str]:
        if spec.kind == "structural_tag":
            return structural_tag.unsupported(spec.value)
        if spec.kind in KINDS:
            return []
        return [f"llguidance does not compile {spec.kind!r} (it compiles {KINDS})"]

    def compile(self, spec: GrammarSpec) -> Grammar:
        key = json.dumps([spec.kind, spec.value], sort_keys=True)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        if compiled is None:
            compiled = llg.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
            if compiled.is_error():
                raise ValueError(f"invalid {spec.kind}: {_first_line(compiled.get_error())}")
            with self._lock:
                self._cache[key] = compiled
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return LLGuidanceGrammar(compiled.deep_copy(), self.eos)


def grammar_text(spec: GrammarSpec) -> str:
    """``spec`` as an llguidance grammar; ValueError for a spec no grammar can come from."""
    if spec.kind in ("json", "json_object"):
        schema = ANY_OBJECT if spec.kind == "json_object" else spec.value
        if schema is True:  # any value; llguidance applies its options to object schemas only
            schema = {}
        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            return llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)  # type: ignore[arg-type]
        except ValueError as exc:  # not JSON, or not an object
            raise ValueError(f"invalid json: {_first_line(str(exc))}") from None
    if spec.kind == "regex":
        if not isinstance(spec.value, str):
            raise ValueError("invalid regex: a regex is a string")
        return llg.LLMatcher.grammar_from_lark(f"start: /{llg.regex_to_lark(spec.value, ECMASCRIPT_ASCII)}/")
    if spec.kind == "grammar":
        if not isinstance(spec.value, str):
            raise ValueError("invalid grammar: a grammar is a string")
        try:
            return llg.LLMatcher.grammar_from_lark(any_to_lark(spec.value))
        except Exception as exc:  # noqa: BLE001 - the GBNF converter raises its own kinds
            raise ValueError(f"invalid grammar: {_first_line(str(exc))}") from None
    if spec.kind == "structural_tag":
        try:
            return llg.LLMatcher.grammar_from_lark(structural_tag.to_lark(spec.value, JSON_LAYOUT))
        except ValueError as exc:
            raise ValueError(f"invalid structural_tag: {_first_line(str(exc))}") from None
    choices = spec.value
    if not isinstance(choices, list | tuple) or not all(isinstance(c, str) and c for c in choices or [""]):
        raise ValueError("choice needs a non-empty list of non-empty strings")
    return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "rejected"
