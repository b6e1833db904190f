"""Reading gpt-oss's harmony output, under vLLM's names: the ``openai_gptoss`` reasoning
parser (the ``analysis`` channel is the reasoning) and the ``openai`` tool parser (a
``commentary`` message to ``functions.NAME`` is a call of NAME, its body the arguments).

The output is a run of messages, each ``<|start|>ROLE`` (left out for the first, which the
prompt opened) and a header up to ``<|message|>``, e.g. ``<|channel|>commentary
to=functions.get_weather <|constrain|>json``, then the body up to ``<|end|>``, ``<|call|>``
or ``<|return|>`` (the last two stop generation, so they may not arrive as text). The markers
are special tokens, so both parsers ask for special tokens kept in the text they are fed.

The reasoning parser hands the ``final`` channel (and ``commentary`` without a recipient, a
tool-call preamble) on as plain content, and a message with a recipient on whole, in harmony,
for the tool parser, which reads plain text and harmony messages alike: it serves alone too.
"""

from __future__ import annotations

import re

import attrs

from engine.interfaces import ReasoningParser, ToolCall, ToolParser

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>([^\s<]+)")


@attrs.frozen
class Header:
    channel: str | None
    recipient: str | None
    text: str  # as written, from its opening marker through <|message|>

    @classmethod
    def parse(cls, text: str) -> Header:
        channel, recipient = _CHANNEL.search(text), _RECIPIENT.search(text)
        return cls(channel and channel.group(1), recipient and recipient.group(1), text)


@attrs.frozen
class Piece:
    """Body text of the open message (``header`` None: text outside any message)."""

    header: Header | None
    text: str


@attrs.frozen
class Done:
    """A whole message: its header, body and the marker that ended it."""

    header: Header
    body: str
    end: str

    def harmony(self) -> str:
        return self.header.text + self.body + self.end


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that could begin one of ``markers``."""
    return max(
        (k for m in markers for k in range(1, min(len(m), len(text) + 1)) if m.startswith(text[-k:])),
        default=0,
    )


class HarmonyStream:
    """Harmony text, fed in pieces -> :class:`Piece` and :class:`Done` events, holding back
    only text that may still be the start of a marker."""

    def __init__(self):
        self.pending = ""
        self.header: Header | None = None
        self.header_text: str | None = None  # set while a header is being read
        self.body = ""

    def feed(self, text: str) -> list[Piece | Done]:
        self.pending += text
        events: list[Piece | Done] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Piece | Done]:
        """End of output: an open message ends (its stop token is not in the text); a header
        cut off before its body (``max_tokens``) is dropped, as it says nothing."""
        events: list[Piece | Done] = []
        rest, self.pending = self.pending, ""
        if self.header is not None:  # in a body (a header being read has no header yet)
            events += [Piece(self.header, rest)] if rest else []
            events.append(Done(self.header, self.body + rest, CALL if self.header.recipient else RETURN))
        elif self.header_text is None and rest:
            events.append(Piece(None, rest))
        self.header, self.header_text, self.body = None, None, ""
        return events

    def _step(self, events: list) -> bool:
        """Consume what can be consumed of ``pending``; True while more may follow."""
        if self.header_text is not None:
            at = self.pending.find(MESSAGE)
            if at == -1:
                return False
            self.header = Header.parse(self.header_text + self.pending[: at + len(MESSAGE)])
            self.header_text, self.pending, self.body = None, self.pending[at + len(MESSAGE) :], ""
            return True
        if self.header is not None:
            return self._body(events)
        hits = [(at, m) for m in (START, CHANNEL) if (at := self.pending.find(m)) != -1]
        if not hits:
            self._emit(events, None, len(self.pending) - _held(self.pending, (START, CHANNEL)))
            return False
        at, marker = min(hits)
        self._emit(events, None, at)
        self.header_text, self.pending = marker, self.pending[len(marker) :]
        return True

    def _body(self, events: list) -> bool:
        hits = [(at, m) for m in (END, CALL, RETURN) if (at := self.pending.find(m)) != -1]
        if not hits:
            self._emit(events, self.header, len(self.pending) - _held(self.pending, (END, CALL, RETURN)))
            return False
        at, marker = min(hits)
        self._emit(events, self.header, at)
        assert self.header is not None
        events.append(Done(self.header, self.body, marker))
        self.header, self.body, self.pending = None, "", self.pending[len(marker) :]
        return True

    def _emit(self, events: list, header: Header | None, upto: int) -> None:
        piece, self.pending = self.pending[:upto], self.pending[upto:]
        if piece:
            events.append(Piece(header, piece))
            if header is not None:
                self.body += piece


def _is_content(header: Header | None) -> bool:
    """Plain text, the final answer, or commentary addressed to no tool (a preamble)."""
    return (
        header is None
        or header.channel == "final"
        or (header.channel == "commentary" and not header.recipient)
    )


class HarmonyReasoningParser(ReasoningParser):
    """``analysis`` -> reasoning; ``final`` -> content; a message to a tool -> content, whole
    and in harmony, for the tool parser."""

    needs_special_tokens = True

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.stream = HarmonyStream()

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self.stream.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._split(self.stream.finish())

    @staticmethod
    def _split(events: list[Piece | Done]) -> tuple[str, str]:
        reasoning, content = [], []
        for event in events:
            if isinstance(event, Piece) and event.header is not None and event.header.channel == "analysis":
                reasoning.append(event.text)
            elif isinstance(event, Piece) and _is_content(event.header):
                content.append(event.text)
            elif isinstance(event, Done) and event.header.recipient:
                content.append(event.harmony())
        return "".join(reasoning), "".join(content)


class HarmonyToolParser(ToolParser):
    """A message to ``functions.NAME`` -> a call of NAME with its body as the arguments;
    ``final`` text and plain text -> content; ``analysis`` is not content (with the
    ``openai_gptoss`` reasoning parser it is the reasoning)."""

    needs_special_tokens = True

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.stream = HarmonyStream()

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return self._split(self.stream.feed(text))

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._split(self.stream.finish())

    @staticmethod
    def _split(events: list[Piece | Done]) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        for event in events:
            if isinstance(event, Piece) and _is_content(event.header):
                content.append(event.text)
            elif isinstance(event, Done) and event.header.recipient:
                name = event.header.recipient.removeprefix("functions.")
                calls.append(ToolCall(name, event.body.strip()))
        return "".join(content), calls
