"""The reasoning-aware grammar: with a reasoning parser on (``--reasoning-parser``, unless
``structured_outputs_config.enable_in_reasoning``), a request's grammar constrains only the
answer after the reasoning block. The thinking text is free; the grammar starts at the token
after the end marker, so the content the server's reasoning parser splits off is exactly
what the grammar constrained (vLLM's "reasoner" structured outputs).

One wrapper for every backend: :class:`ReasoningGate` is itself a :class:`Grammar` around
the backend's, fed the same tokens, and passes them on only once the reasoning has ended.
It reads the reasoning parser's :class:`ReasoningMarkers` (single token ids) and follows the
parser's text rules: ``starts_inside`` (deepseek_r1: the template opened ``<think>``) means
reasoning until ``</think>``; otherwise (qwen3) the output is the answer unless its first
token opens ``<think>``, so the first mask is the grammar's plus that token."""

from __future__ import annotations

import logging

from engine.interfaces.grammar import Grammar
from engine.interfaces.reasoning_parser import ReasoningMarkers

logger = logging.getLogger(__name__)
OPEN = "open"  # nothing yet: the first token opens the reasoning or starts the answer
REASONING = "reasoning"
ANSWER = "answer"  # the grammar's tokens from here on
DONE = "done"  # EOS accepted inside the reasoning


class ReasoningGate(Grammar):
    def __init__(self, grammar: Grammar, markers: ReasoningMarkers, eos: int):
        self.grammar, self.markers, self.eos = grammar, markers, eos
        self.start = REASONING if markers.starts_inside else OPEN
        self.phase = self.start
        # per accepted token: the phase after it, and whether the grammar took it
        self.history: list[tuple[str, bool]] = []

    def _step(self, token: int) -> tuple[str, bool]:
        """The phase after ``token``, and whether it is the grammar's to accept."""
        if self.phase == ANSWER or (self.phase == OPEN and token != self.markers.start):
            return ANSWER, True
        if self.phase == OPEN:
            return REASONING, False
        if token == self.markers.end:
            return ANSWER, False
        return (DONE if token == self.eos else REASONING), False

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for accepted, token in enumerate(token_ids):
            phase, to_grammar = self._step(token)
            if self.phase == DONE or (to_grammar and not self.grammar.accept_tokens([token])):
                self.rollback(accepted)
                return False
            self.phase = phase
            self.history.append((phase, to_grammar))
        return True

    def fill_bitmask(self, bitmask, row: int) -> None:
        if self.phase in (ANSWER, OPEN):
            self.grammar.fill_bitmask(bitmask, row)
            if self.phase == OPEN:  # the grammar's first tokens, or the one that opens the reasoning
                start = self.markers.start
                bitmask[row, start // 32] |= _bit(start % 32)
        else:  # the reasoning is free; the core ends the request at an EOS there as usual
            bitmask[row] = -1

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        undone = self.history[-num_tokens:]
        del self.history[-num_tokens:]
        taken = sum(to_grammar for _, to_grammar in undone)
        if taken:
            self.grammar.rollback(taken)
        self.phase = self.history[-1][0] if self.history else self.start

    def is_terminated(self) -> bool:
        return self.phase == DONE or (self.phase == ANSWER and self.grammar.is_terminated())

    def reset(self) -> None:
        self.grammar.reset()
        self.phase, self.history = self.start, []


def _bit(index: int) -> int:
    """Bit ``index`` of an int32 word, as a signed value (bit 31 is the sign)."""
    return -(2**31) if index == 31 else 1 << index


def reasoning_markers(registry, config, tokenizer) -> ReasoningMarkers | None:
    """The markers the engine's grammars wait out: those of ``config.reasoning_parser`` unless
    ``enable_in_reasoning`` (or no parser, or one without single-token markers: the grammar
    then spans the whole output, which is logged)."""
    if config.reasoning_parser is None or config.enable_in_reasoning:
        return None
    markers = registry.get("reasoning_parsers", config.reasoning_parser)(tokenizer).grammar_markers()
    if markers is None:
        logger.warning(
            "reasoning parser %s gives no single-token markers: grammars apply to the whole output",
            config.reasoning_parser,
        )
    return markers
