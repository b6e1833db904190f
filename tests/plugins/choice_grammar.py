"""Test plugin for the grammar seam: a choice list compiled into a token trie."""

from __future__ import annotations

import time

from engine import hookimpl
from engine.interfaces import Grammar, GrammarBackend, GrammarSpec


@hookimpl
def register_grammar_backends(register):
    register("test-choice", ChoiceBackend, api=1)


class ChoiceGrammar(Grammar):
    def __init__(self, choices: list[list[int]], eos: int | None):
        self.choices, self.eos, self.tokens = choices, eos, []

    def _matching(self):
        n = len(self.tokens)
        return [c for c in self.choices if c[:n] == self.tokens]

    def accept_tokens(self, token_ids):
        for t in token_ids:
            if t not in self._allowed():
                return False
            self.tokens.append(t)
        return True

    def _allowed(self) -> set[int]:
        n = len(self.tokens)
        return {c[n] for c in self._matching() if len(c) > n}

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        for t in self._allowed():
            bitmask[row, t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -(1 << 31)

    def rollback(self, num_tokens):
        del self.tokens[len(self.tokens) - num_tokens:]

    def is_terminated(self):
        return any(c == self.tokens for c in self.choices)

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
        return ChoiceGrammar(choices, None)
