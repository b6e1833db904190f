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
        self.tools: dict[str, dict] = {}

    def use_tools(self, tools: dict[str, dict]) -> None:
        """The request's tools by name (OpenAI ``function`` objects: ``name``, ``parameters``),
        given before the first :meth:`feed` (since v2): a format whose arguments are not JSON
        reads their types from the schemas."""
        self.tools = tools

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


class MarkedToolParser(ToolParser):
    """A base for formats that announce calls with a marker: text before it streams as
    content, text after it is held until generation ends and then parsed
    (:meth:`parse_calls`); what does not parse is given back as content, so a model that only
    looked like calling a tool loses nothing.
    ``markers``: (text, kept) pairs; a kept marker is part of the calls (a ``[`` or ``{``).
    ``anywhere``: the marker may follow content; otherwise only whitespace may precede it."""

    markers: tuple[tuple[str, bool], ...] = ()
    anywhere = False
    needs_special_tokens = True  # markers such as [TOOL_CALLS] are special tokens

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.pending = ""  # text held back while it may still begin a marker
        self.calls_text: str | None = None  # everything after the marker, once seen
        self.dropped = ""  # the marker, when it is not part of the calls
        self.content_only = False  # start-only formats: the output began with content

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.calls_text is not None:
            self.calls_text += text
            return "", []
        if self.content_only:
            return text, []
        self.pending += text
        found = self._find_marker()
        if found is not None:
            at, marker, kept = found
            content = self.pending[:at]
            self.calls_text = self.pending[at if kept else at + len(marker) :]
            self.dropped, self.pending = ("" if kept else marker), ""
            return content, []
        if not self.anywhere:
            head = self.pending.lstrip()
            if head and not any(m.startswith(head) for m, _ in self.markers):
                self.content_only = True
                content, self.pending = self.pending, ""
                return content, []
            return "", []
        keep = max(
            (
                k
                for m, _ in self.markers
                for k in range(1, min(len(m), len(self.pending) + 1))
                if self.pending.endswith(m[:k])
            ),
            default=0,
        )
        content, self.pending = (
            self.pending[: len(self.pending) - keep],
            self.pending[len(self.pending) - keep :],
        )
        return content, []

    def _find_marker(self) -> tuple[int, str, bool] | None:
        if not self.anywhere:
            head = self.pending.lstrip()
            at = len(self.pending) - len(head)
            return next(((at, m, kept) for m, kept in self.markers if head.startswith(m)), None)
        hits = [(self.pending.find(m), m, kept) for m, kept in self.markers if m in self.pending]
        return min(hits) if hits else None

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self.calls_text is None:
            rest, self.pending = self.pending, ""
            return rest, []
        text, self.calls_text = self.calls_text, None
        calls = self.parse_calls(text.strip())
        return (self.dropped + text, []) if calls is None else ("", calls)

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        """The calls in ``text`` (after the marker, stripped), or None if it is not a valid call
        list."""
        raise NotImplementedError
