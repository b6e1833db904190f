"""Planted bugs: the xgrammar backend (and, for a mistake of its own kind, the llguidance
backend) with one mistake each, the mistakes grammar backend
authors make (several were made, and shipped, while the kit passed). Not registered by the
suite's conftest: ``tests/test_grammar_kit_mutations.py`` registers them in a child pytest
that runs the grammar kit on each, and checks that it fails."""

from __future__ import annotations

import json

import attrs
import torch

from engine import hookimpl
from engine_grammar_llguidance.backend import LLGuidanceBackend, LLGuidanceGrammar
from engine_grammar_xgrammar.backend import XGrammar, XGrammarBackend


class Mutant(XGrammar):
    def __init__(self, grammar: XGrammar):  # takes over a correctly compiled grammar's matcher
        self.matcher = grammar.matcher


class OrBits(Mutant):
    """Sets the allowed bits in the row instead of writing it: right on a zeroed row, allows
    everything on the engine's all-allowed (-1) rows."""

    def fill_bitmask(self, bitmask, row):
        mine = torch.zeros_like(bitmask[row : row + 1])
        self.matcher.fill_next_token_bitmask(mine)
        bitmask[row] |= mine[0]


class TokenizerWidth(Mutant):
    """Fills ``ceil(len(tokenizer) / 32)`` words: the padding ids past them stay allowed."""

    def __init__(self, grammar: XGrammar, vocab: int):
        super().__init__(grammar)
        self.words = -(-vocab // 32)

    def fill_bitmask(self, bitmask, row):
        self.matcher.fill_next_token_bitmask(bitmask[row : row + 1, : self.words])


class EndsWhenItCould(Mutant):
    """Terminated as soon as the output could end: the choice "deep blue sea" is cut to "deep"."""

    def is_terminated(self):
        return self.matcher.is_completed()


class PartialAccept(Mutant):
    """Keeps the tokens before a refused one."""

    def accept_tokens(self, token_ids):
        return all(self.matcher.accept_token(t) for t in token_ids)


class ResetKeepsState(Mutant):
    """``reset`` left out, since the engine never calls it."""

    def reset(self):
        pass


class EosFlag(Mutant):
    """Remembers EOS in a flag that rollback does not clear: a rolled-back EOS draft still ends
    the request."""

    def __init__(self, grammar: XGrammar):
        super().__init__(grammar)
        self.ended = False

    def accept_tokens(self, token_ids):
        accepted = super().accept_tokens(token_ids)
        self.ended |= accepted and any(t in self.matcher.stop_token_ids for t in token_ids)
        return accepted

    def is_terminated(self):
        return self.ended

    def reset(self):
        super().reset()
        self.ended = False


class EosNeverRecorded(LLGuidanceGrammar):
    """On llguidance, which keeps no history entry for EOS taken once the grammar has stopped,
    treats every EOS so: rolling back an EOS taken where the output could go on ("deep") rolls
    back nothing, and the grammar stays at its end."""

    def accept_tokens(self, token_ids):
        accepted = super().accept_tokens(token_ids)
        if accepted and token_ids and token_ids[-1] == self.eos:
            self.eos_unrecorded = True
        return accepted


class EosNeverRecordedBackend(LLGuidanceBackend):
    def compile(self, spec):
        grammar = super().compile(spec)
        return EosNeverRecorded(grammar.matcher, grammar.eos)


def _backend(grammar_cls) -> type:
    """The xgrammar backend handing out ``grammar_cls`` grammars."""

    def compile(self, spec):
        return grammar_cls(XGrammarBackend.compile(self, spec))

    return type(f"{grammar_cls.__name__}Backend", (XGrammarBackend,), {"compile": compile})


class TokenizerWidthBackend(XGrammarBackend):
    """Sizes the vocabulary by ``len(tokenizer)``, not the model's ``ctx.vocab_size``."""

    def __init__(self, ctx):
        super().__init__(attrs.evolve(ctx, vocab_size=len(ctx.tokenizer)))

    def compile(self, spec):
        return TokenizerWidth(super().compile(spec), len(self.ctx.tokenizer))


class AnyJsonBackend(XGrammarBackend):
    """``json_object`` compiled as any JSON value (xgrammar's builtin JSON grammar), arrays too."""

    def _compile(self, spec):
        if spec.kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        return super()._compile(spec)


class SharedGrammarBackend(XGrammarBackend):
    """Caches the grammar itself rather than its compiled form: requests with one spec share
    one state."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self._grammars = {}

    def compile(self, spec):
        key = json.dumps([spec.kind, spec.value], sort_keys=True)
        if key not in self._grammars:
            self._grammars[key] = super().compile(spec)
        return self._grammars[key]


MUTANTS = {
    "or-bits": _backend(OrBits),
    "tokenizer-width": TokenizerWidthBackend,
    "ends-when-it-could": _backend(EndsWhenItCould),
    "json-any-value": AnyJsonBackend,
    "partial-accept": _backend(PartialAccept),
    "reset-keeps-state": _backend(ResetKeepsState),
    "eos-flag": _backend(EosFlag),
    "shared-grammar": SharedGrammarBackend,
    "eos-never-recorded": EosNeverRecordedBackend,
}


@hookimpl
def register_grammar_backends(register):
    for name, backend in MUTANTS.items():
        register(name, backend, api=2)
