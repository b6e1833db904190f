"""ToolParser: turns a model's own tool-call format into OpenAI tool calls (server side,
for ``tool_choice="auto"``). One instance per generated sequence; text arrives in pieces."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import attrs


@attrs.frozen
class ToolCall:
    """A call, or (streamed) the beginning of one: its name and the arguments known so far;
    :class:`ArgumentsDelta` items after it carry the rest."""

    name: str
    arguments: str  # JSON text


@attrs.frozen
class ArgumentsDelta:
    """More arguments text for the call last begun (since v3): a parser that streams a call
    gives its :class:`ToolCall` as soon as the name is known, then these as the arguments are
    generated; their concatenation is the call's whole arguments."""

    arguments: str


#: What ``feed`` and ``finish`` give after the content: whole calls, or streamed ones.
CallPieces = list[ToolCall | ArgumentsDelta]


def marker_tail(text: str, markers: Iterable[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``markers`` without being
    all of it: the characters to hold back while the next piece may complete the marker."""
    return max(
        (k for m in markers for k in range(1, min(len(m), len(text) + 1)) if text.endswith(m[:k])),
        default=0,
    )


def join_calls(pieces: CallPieces) -> list[ToolCall]:
    """The whole calls that streamed ``pieces`` make."""
    calls: list[ToolCall] = []
    for piece in pieces:
        if isinstance(piece, ToolCall):
            calls.append(piece)
        else:
            calls[-1] = attrs.evolve(calls[-1], arguments=calls[-1].arguments + piece.arguments)
    return calls


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
    def feed(self, text: str) -> tuple[str, CallPieces]:
        """New generated text -> (content safe to show now, the calls it completed or, for a
        parser that streams them, began and continued: see :class:`ArgumentsDelta`). Text
        that may still turn out to open a tool call is held back."""

    @abstractmethod
    def finish(self) -> tuple[str, CallPieces]:
        """End of generation -> the held-back content and any last call (or the rest of it)."""


class MarkedToolParser(ToolParser):
    """A base for formats that announce calls with a marker: text before it streams as
    content, text after it is the calls. By default that text is held until generation ends
    and then parsed (:meth:`parse_calls`); what does not parse is given back as content, so a
    model that only looked like calling a tool loses nothing. A format that implements
    :meth:`partial_calls` streams its calls instead: each name as soon as it is known, then its
    arguments as they become final; once a call has begun it stands, so a call cut off (by
    ``max_tokens``) keeps the arguments that arrived.
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
        self.sent: list[ToolCall] = []  # streamed calls as far as they have been given

    def feed(self, text: str) -> tuple[str, CallPieces]:
        if self.calls_text is not None:
            self.calls_text += text
            return "", self._stream(self.partial_calls(self.calls_text))
        if self.content_only:
            return text, []
        self.pending += text
        found = self._find_marker()
        if found is not None:
            at, marker, kept = found
            content = self.pending[:at]
            self.calls_text = self.pending[at if kept else at + len(marker) :]
            self.dropped, self.pending = ("" if kept else marker), ""
            return content, self._stream(self.partial_calls(self.calls_text))
        if not self.anywhere:
            head = self.pending.lstrip()
            if head and not any(m.startswith(head) for m, _ in self.markers):
                self.content_only = True
                content, self.pending = self.pending, ""
                return content, []
            return "", []
        keep = marker_tail(self.pending, (m for m, _ in self.markers))
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

    def finish(self) -> tuple[str, CallPieces]:
        if self.calls_text is None:
            rest, self.pending = self.pending, ""
            return rest, []
        text, self.calls_text = self.calls_text, None
        calls = self.parse_calls(text.strip())
        if self.sent:  # streamed calls stand; the whole text may only complete them
            return "", self._stream(calls)
        return (self.dropped + text, []) if calls is None else ("", list(calls))

    def _stream(self, calls: list[ToolCall] | None) -> CallPieces:
        """The pieces that take the calls given so far to ``calls``: a new call's
        :class:`ToolCall`, an earlier one's :class:`ArgumentsDelta`. It stops at the first call
        that does not extend what was given (only the last call given may grow), so nothing given
        ever changes."""
        pieces: CallPieces = []
        for i, call in enumerate(calls or []):
            if i == len(self.sent):
                self.sent.append(call)
                pieces.append(call)
                continue
            given = self.sent[i]
            last = i == len(self.sent) - 1  # only the call last begun may still grow
            if call != given and not (
                last and call.name == given.name and call.arguments.startswith(given.arguments)
            ):
                break
            if len(call.arguments) > len(given.arguments):
                pieces.append(ArgumentsDelta(call.arguments[len(given.arguments) :]))
                self.sent[i] = call
        return pieces

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        """The calls in ``text`` (after the marker, stripped), or None if it is not a valid call
        list."""
        raise NotImplementedError

    def partial_calls(self, text: str) -> list[ToolCall] | None:
        """For a format that streams its calls (since v3): the calls begun in ``text`` (all of
        it after the marker so far, cut anywhere), each with the part of its arguments that no
        later text can change; at the end :meth:`parse_calls` must give these same calls,
        complete. None (the default): calls arrive whole when generation ends."""
        return None
