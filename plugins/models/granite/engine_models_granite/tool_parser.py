"""``granite``: IBM Granite 3.x tool calls (vLLM's name), as its chat template asks for them:
``<|tool_call|>`` and a JSON list of ``{"name": ..., "arguments": {...}}``, at the start of
the answer. A call's arguments are the object's JSON text as the model wrote it (a string of
JSON, decoded), streamed as it arrives once the name is known."""

from __future__ import annotations

import json

from engine.interfaces import MarkedToolParser, ToolCall

SPACE = " \t\n\r"


class GraniteToolParser(MarkedToolParser):
    markers = (("<|tool_call|>", False),)

    def parse_calls(self, text):
        try:
            items = json.loads(text)
            valid = isinstance(items, list) and all(
                isinstance(item["name"], str) and isinstance(item.get("arguments", {}), dict | str)
                for item in items
            )
        except (ValueError, KeyError, TypeError):
            return None
        calls, end = scan(text)
        return calls if valid and calls and len(calls) == len(items) and end == len(text) else None

    def partial_calls(self, text):
        return scan(text)[0]


def scan(text: str) -> tuple[list[ToolCall], int | None]:
    """The calls begun in ``text`` (a JSON list, cut anywhere) whose name is complete, each with
    its arguments as far as they are final, and where the list ends (None while it is open)."""
    calls: list[ToolCall] = []
    at = skip(text, 0)
    if not text.startswith("[", at):
        return calls, None
    at = skip(text, at + 1)
    while text.startswith("{", at):
        call, at = item(text, at + 1)
        if call is not None:
            calls.append(call)
        if at is None:
            return calls, None
        at = skip(text, at)
        if not text.startswith(",", at):
            break
        at = skip(text, at + 1)
    return calls, (at + 1 if text.startswith("]", at) else None)


def item(text: str, at: int) -> tuple[ToolCall | None, int | None]:
    """One ``{"name", "arguments"}`` object from just after its ``{``: (its call, once the name is
    known, and where the object ends: None while it is open)."""
    name, arguments, closed = None, None, False
    while True:
        at = skip(text, at)
        if text.startswith("}", at):
            closed, at = True, at + 1
            break
        key_end = value_end(text, at) if text.startswith('"', at) else None
        colon = skip(text, key_end) if key_end is not None else len(text)
        if not text.startswith(":", colon):
            break
        start = skip(text, colon + 1)
        end = value_end(text, start)
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


def value_end(text: str, at: int) -> int | None:
    """Where the JSON value that starts at ``at`` ends, or None if ``text`` ends first."""
    depth, quoted, i = 0, False, at
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            quoted = True
        elif c in "[{":
            depth += 1
        elif c in "]}" and depth > 0:
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and i > at and (c in ",]}" or c in SPACE):
            return i
        i += 1
    return None
