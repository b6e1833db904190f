"""ReasoningParser: splits a reasoning model's output into its reasoning and its answer
(server side: ``reasoning_content`` and ``content`` of a chat message, chosen with
``engine serve --reasoning-parser NAME``). One instance per generated sequence; text
arrives in pieces, and tool-call parsing runs on the answer part only."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class ReasoningParser(ABC):
    #: True when the format's markers are special tokens that detokenization would drop.
    needs_special_tokens: bool = False

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    @abstractmethod
    def feed(self, text: str) -> tuple[str, str]:
        """New generated text -> (reasoning, content) safe to show now; text that may still
        turn out to be a marker is held back."""

    @abstractmethod
    def finish(self) -> tuple[str, str]:
        """End of generation -> the held-back (reasoning, content)."""
