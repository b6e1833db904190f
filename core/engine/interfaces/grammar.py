"""GrammarBackend: structured outputs. The core keeps one :class:`Grammar` per constrained
request, asks it for a token bitmask each step, masks the logits in one batched op, and
feeds it the sampled tokens.

**Threads.** ``GrammarBackend.supports`` runs on the step loop when a request arrives;
``GrammarBackend.compile`` on the engine's compile thread (one per engine, at a lower CPU
priority), while the step loop keeps using other grammars of the same backend: whatever
``compile`` shares with them (caches, the tokenizer's tables) must be safe for that. Every
:class:`Grammar` method runs on the step loop, one call at a time.

**Bitmask** (xgrammar's layout): int32 ``[rows, ceil(vocab_size / 32)]``, bit ``t % 32`` of
word ``t // 32`` set when token ``t`` is allowed. ``vocab_size`` is
``GrammarContext.vocab_size``, the model's logits width, usually larger than the tokenizer:
ids from ``len(tokenizer)`` up are padding, which a grammar never allows. Bits past
``vocab_size`` in the last word are ignored.

**EOS** is ``GrammarContext.tokenizer.eos_token_id``. A grammar allows it exactly where the
output may end, and accepting it ends the output (:meth:`Grammar.is_terminated`).

**Kinds** (``GrammarSpec.kind``; a backend that does not compile one says why in
``supports``). The output is the generated text without the EOS; for all kinds the whole of
it must match, nothing before or after:

- ``json``: a JSON value valid under ``value``, a JSON Schema (a dict, or its JSON text). A
  backend may be stricter than the schema (xgrammar generates no property the schema does
  not list), never looser.
- ``json_object``: a JSON object, any members (OpenAI's ``response_format`` ``json_object``):
  never an array, string, number, ``true``, ``false`` or ``null`` at the top.
- JSON layout, both JSON kinds and the JSON in structural tags: ``json.dumps``'s default
  one, so output does not change with the backend: ``", "`` between items, ``": "`` after
  keys, no other whitespace outside strings (no newline, no indent, none before or after the
  value).
- ``regex``: text that ``value`` matches in full (anchored at both ends), in the ECMAScript
  dialect of JSON Schema's ``pattern``: classes, ``\\d \\w \\s``, ``* + ? {m,n}``, groups and
  ``|``; no backreferences or lookaround.
- ``grammar``: text in the language of ``value``, GBNF (llama.cpp's EBNF, as xgrammar reads
  it): ``name ::= ...`` rules starting at ``root``, double-quoted literals, ``[...]`` classes,
  ``( )``, ``|``, ``* + ?`` and ``{m,n}``. A backend may read other syntaxes besides (the
  llguidance backend reads Lark, as vLLM's ``guided_grammar`` does with llguidance).
- ``choice``: exactly one of the strings of ``value`` (a non-empty list of non-empty strings).
- ``structural_tag`` (since v3): ``value`` is an xgrammar structural tag,
  ``{"type": "structural_tag", "format": FORMAT}``. Every v3 backend reads at least these
  formats: ``const_string`` (``value``), ``json_schema`` (``json_schema``: JSON valid under
  it), ``sequence`` / ``or`` (``elements``), ``tag`` (``begin``, ``content``: a format, ``end``:
  strings; ``end`` may be a list of them), ``any_text`` (any text) as a tag's content or at
  the end of the output, and, at the end of the output, ``triggered_tags`` (``triggers``,
  ``tags``): any text until one of ``triggers`` appears, which must open the ``begin`` of one
  of ``tags``; that tag follows in full, then any text again, as often as the model likes
  (the tool calls vLLM's ``structural_tag`` response format describes). A backend refuses,
  in ``supports``, what else it does not read (xgrammar reads all its formats: ``regex``,
  ``grammar``, ``tags_with_separator``, ``at_least_one`` ...).

``engine.testing.grammar.GrammarBackendContract`` checks all of this on a tiny tokenizer.
"""

from abc import ABC, abstractmethod
from typing import Any

import attrs
import torch

from engine.messages.sampling_params import GrammarSpec

# kinds added after v2, with the interface version that added them: the core never hands a
# backend registered for an older version a spec of a newer kind
KIND_SINCE = {"structural_tag": 3}


@attrs.frozen
class GrammarContext:
    """What a grammar backend is constructed with."""

    tokenizer: Any  # the model's transformers tokenizer
    vocab_size: int  # the model's logits width (bitmask rows cover it; ids past the tokenizer are padding)


class Grammar(ABC):
    """One request's compiled constraint and its position in it. Called on the step loop only."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``, all or nothing: False, with the state unchanged, if one
        of them is not allowed where it comes (a token after EOS never is).

        The core calls it with each sampled token, EOS included, right after sampling, and
        with draft tokens (then rolls them back) to cut drafts at the first refused one. A
        sampled token is one the mask allowed, so False for it means the grammar contradicts
        its own mask: the core finishes that request with an error."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]``, every word of it, and no other
        row (see the module's layout and width). The core fills every row with -1 (all
        allowed) first, so setting bits alone allows everything. EOS is allowed exactly where
        the output may end; padding ids never are.

        Called once per step for each sampling row of the request, before sampling: with k
        drafts to verify, rows j = 0..k hold the mask after the first j drafts (the core
        accepts them one at a time between the calls and rolls them back). Not called once
        :meth:`is_terminated` is True."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens, EOS included (a rolled-back EOS makes
        :meth:`is_terminated` False again), as if they had never been accepted. The core
        rolls back the drafts it accepted to check them and to fill their rows; never more
        tokens than it accepted since compile (or :meth:`reset`)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True exactly when the last accepted token is EOS. Where the output could end but
        go on ("deep" of the choices "deep" and "deep blue sea"), it stays False and the mask
        allows EOS and the longer match: the model decides.

        The core asks after each accepted sampled token (once ``min_tokens`` are out) and
        finishes the request with ``"stop"`` when it is True, so this is what stops a
        request even when it ignores EOS or its EOS is not the tokenizer's."""

    @abstractmethod
    def reset(self) -> None:
        """Return to the state just after compile: nothing accepted, not terminated, the first
        mask. The engine does not call it today (a request keeps its grammar from compile to
        finish; preemption keeps its tokens); it is for a backend's own reuse of grammars and
        for callers other than the engine, and the kit checks it."""


class GrammarBackend(ABC):
    def __init__(self, ctx: Any):
        """``ctx`` is a :class:`GrammarContext` (tokenizer, vocab size). Constructed once per
        engine, on the step loop, at the first request with structured outputs."""
        self.ctx = ctx

    @classmethod
    def supports(cls, spec: GrammarSpec) -> list[str]:
        """Why this backend cannot compile ``spec`` (one reason per problem; empty: it can).
        Called on the step loop as a request arrives; a reason fails that request alone."""
        return []

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Grammar:
        """A new :class:`Grammar` at the start of ``spec``, of its own: two compiles of one spec
        (``n > 1`` children) never share a state. Called off the step loop, on the engine's
        compile thread, while the request waits. Raise ValueError for an invalid spec; that
        request alone fails."""
