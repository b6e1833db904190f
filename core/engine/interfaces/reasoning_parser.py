"""ReasoningParser: splits a reasoning model's output into its reasoning and its answer
(server side: ``reasoning_content`` and ``content`` of a chat message, chosen with
``engine serve --reasoning-parser NAME``). One instance per generated sequence; text
arrives in pieces, and tool-call parsing runs on the answer part only."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import attrs


@attrs.frozen
class ReasoningMarkers:
    """Where a reasoning block opens and closes, as single token ids of the model's tokenizer,
    for the core's reasoning-aware grammar (:mod:`engine.core.reasoning_gate`)."""

    start: int  # the token that opens the reasoning (``<think>``)
    end: int  # the token that closes it (``</think>``)
    starts_inside: bool  # the output starts inside the reasoning (the chat template opened it)


class ReasoningParser(ABC):
    #: True when the format's markers are special tokens that detokenization would drop.
    needs_special_tokens: bool = False

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    @abstractmethod
    def feed(self, text: str) -> tuple[str, str]:
        """New generated text -> (reasoning, content) safe to show now; text that may still
        turn out to be a marker is held back."""

    def grammar_markers(self) -> ReasoningMarkers | None:
        """The markers as the core's grammar gate reads them (since v2): a request's grammar
        then applies only after the reasoning, exactly where :meth:`feed` starts the content.
        None (the default): the format has no single-token markers, and a grammar spans the
        whole output."""
        return None

    @abstractmethod
    def finish(self) -> tuple[str, str]:
        """End of generation -> the held-back (reasoning, content)."""
