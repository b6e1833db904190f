"""Test plugin for the grammar seam: a choice list compiled into a token trie."""

from __future__ import annotations

import time

from engine import hookimpl
from engine.interfaces import Grammar, GrammarBackend, GrammarSpec


@hookimpl
def register_grammar_backends(register):
    register("test-choice", ChoiceBackend, api=2)


class ChoiceGrammar(Grammar):
    """One of the choices, then EOS (allowed once a choice is complete; terminated once accepted)."""

    def __init__(self, choices: list[list[int]], eos: int):
        self.choices, self.eos, self.tokens = choices, eos, []

    def _allowed(self, tokens: list[int]) -> set[int]:
        if tokens[-1:] == [self.eos]:
            return set()
        n = len(tokens)
        allowed = {c[n] for c in self.choices if len(c) > n and c[:n] == tokens}
        return allowed | {self.eos} if tokens in self.choices else allowed

    def accept_tokens(self, token_ids):
        tokens = list(self.tokens)
        for t in token_ids:
            if t not in self._allowed(tokens):
                return False
            tokens.append(t)
        self.tokens = tokens
        return True

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        for t in self._allowed(self.tokens):
            bitmask[row, t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -(1 << 31)

    def rollback(self, num_tokens):
        del self.tokens[len(self.tokens) - num_tokens :]

    def is_terminated(self):
        return self.tokens[-1:] == [self.eos]

    def reset(self):
        self.tokens = []


class ChoiceBackend(GrammarBackend):
    @classmethod
    def supports(cls, spec: GrammarSpec) -> list[str]:
        return [] if spec.kind == "choice" else [f"test-choice compiles only choice lists, not {spec.kind}"]

    def compile(self, spec: GrammarSpec) -> Grammar:
        choices = []
        for choice in spec.value:
            if isinstance(choice, str) and choice.startswith("slow:"):
                time.sleep(float(choice.split(":")[1]))  # a grammar that takes long to compile
                choice = choice.split(":", 2)[2]
            if not choice:
                raise ValueError("empty choice")
            choices.append(self.ctx.tokenizer.encode(choice) if isinstance(choice, str) else list(choice))
        return ChoiceGrammar(choices, self.ctx.tokenizer.eos_token_id)
