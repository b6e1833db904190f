"""``granite``: IBM Granite 3.x tool calls (vLLM's name), as its chat template asks for them:
``<|tool_call|>`` and a JSON list of ``{"name": ..., "arguments": {...}}``, at the start of
the answer. A call's arguments are the object's JSON text as the model wrote it (a string of
JSON, decoded), streamed as it arrives once the name is known."""

from __future__ import annotations

import json
import re

from engine.interfaces import MarkedToolParser, ToolCall

SPACE = " \t\n\r"
STRUCTURE = re.compile(r'["\[\]{}]')
SCALAR_END = re.compile(r"[,\]}\s]")


class GraniteToolParser(MarkedToolParser):
    markers = (("<|tool_call|>", False),)

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.strings = Strings()  # of the text after the marker, which only grows

    def parse_calls(self, text):
        try:
            items = json.loads(text)
            valid = isinstance(items, list) and all(
                isinstance(item["name"], str) and isinstance(item.get("arguments", {}), dict | str)
                for item in items
            )
        except (ValueError, KeyError, TypeError):
            return None
        calls, end = scan(text, Strings())
        return calls if valid and calls and len(calls) == len(items) and end == len(text) else None

    def partial_calls(self, text):
        return scan(text, self.strings)[0]


def scan(text: str, strings: Strings) -> tuple[list[ToolCall], int | None]:
    """The calls begun in ``text`` (a JSON list, cut anywhere) whose name is complete, each with
    its arguments as far as they are final, and where the list ends (None while it is open)."""
    calls: list[ToolCall] = []
    at = skip(text, 0)
    if not text.startswith("[", at):
        return calls, None
    at = skip(text, at + 1)
    while text.startswith("{", at):
        call, at = item(text, at + 1, strings)
        if call is not None:
            calls.append(call)
        if at is None:
            return calls, None
        at = skip(text, at)
        if not text.startswith(",", at):
            break
        at = skip(text, at + 1)
    return calls, (at + 1 if text.startswith("]", at) else None)


def item(text: str, at: int, strings: Strings) -> tuple[ToolCall | None, int | None]:
    """One ``{"name", "arguments"}`` object from just after its ``{``: (its call, once the name is
    known, and where the object ends: None while it is open)."""
    name, arguments, closed = None, None, False
    while True:
        at = skip(text, at)
        if text.startswith("}", at):
            closed, at = True, at + 1
            break
        key_end = value_end(text, at, strings) if text.startswith('"', at) else None
        colon = skip(text, key_end) if key_end is not None else len(text)
        if not text.startswith(":", colon):
            break
        start = skip(text, colon + 1)
        end = value_end(text, start, strings)
        key = json.loads(text[at:key_end])
        if key == "name" and end is not None and text.startswith('"', start):
            name = json.loads(text[start:end])
        elif key == "arguments" and arguments is None:
            arguments = (start, end)
        if end is None:
            break
        at = skip(text, end)
        if text.startswith(",", at):
            at += 1
        elif not text.startswith("}", at):
            break
    if name is None:
        return None, at if closed else None
    return ToolCall(name, final_arguments(text, arguments, closed)), at if closed else None


def final_arguments(text: str, span: tuple[int, int | None] | None, closed: bool) -> str:
    """The arguments' JSON text as far as no later text changes it: an object's text as it
    arrives, a string of JSON once complete (decoded), ``{}`` for an object without any."""
    if span is None:
        return "{}" if closed else ""
    start, end = span
    if end is None:
        return text[start:] if text.startswith("{", start) else ""
    raw = text[start:end]
    return json.loads(raw) if raw.startswith('"') else raw


def skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in SPACE:
        at += 1
    return at


def value_end(text: str, at: int, strings: Strings) -> int | None:
    """Where the JSON value that starts at ``at`` ends, or None if ``text`` ends first. Strings
    and the text between brackets are skipped by searches, not a character at a time, since the
    open value is scanned again on every feed."""
    if text.startswith('"', at):
        return strings.end(text, at)
    if not text.startswith(("{", "["), at):
        scalar_end = SCALAR_END.search(text, at + 1)
        return scalar_end.start() if scalar_end else None
    depth = 0
    while found := STRUCTURE.search(text, at):
        at = found.end()
        if found.group() == '"':
            end = strings.end(text, found.start())
            if end is None:
                return None
            at = end
        elif found.group() in "[{":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return at
    return None


class Strings:
    """Where the JSON strings of one growing text end, remembered: the open value is scanned
    again on every feed, so each string is searched once, from where the last search stopped."""

    def __init__(self):
        self.ends: dict[int, int] = {}
        self.searched: dict[int, int] = {}  # an open string's start -> the last index searched

    def end(self, text: str, at: int) -> int | None:
        """Just after the quote that closes the string opening at ``at``; None while it is open."""
        if at in self.ends:
            return self.ends[at]
        quote = self.searched.get(at, at)
        while (quote := text.find('"', quote + 1)) != -1:
            escapes = quote
            while text[escapes - 1] == "\\":
                escapes -= 1
            if (quote - escapes) % 2 == 0:
                self.ends[at] = quote + 1
                return quote + 1
        self.searched[at] = len(text) - 1
        return None
