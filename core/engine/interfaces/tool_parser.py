"""ToolParser: turns a model's own tool-call format into OpenAI tool calls (server side,
for ``tool_choice="auto"``). One instance per generated sequence; text arrives in pieces."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import attrs


@attrs.frozen
class ToolCall:
    name: str
    arguments: str  # JSON text


class ToolParser(ABC):
    #: True when the format's markers are special tokens (Mistral's ``[TOOL_CALLS]``, Llama's
    #: ``<|python_tag|>``): the server then keeps special tokens in the text it feeds.
    needs_special_tokens: bool = False

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def system_prompt(self, tools: list[dict]) -> str | None:
        """Instructions that present ``tools`` (OpenAI ``tools`` entries) to a model whose chat
        template does not render them; None if the parser has none."""
        return None

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """New generated text -> (content safe to show now, tool calls it completed). Text
        that may still turn out to open a tool call is held back."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of generation -> the held-back content and any last call."""
