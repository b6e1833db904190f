"""``granite``: IBM Granite 3.x tool calls (vLLM's name), as its chat template asks for them:
``<|tool_call|>`` and a JSON list of ``{"name": ..., "arguments": {...}}``, at the start of
the answer."""

from __future__ import annotations

import json

from engine.interfaces import MarkedToolParser, ToolCall


class GraniteToolParser(MarkedToolParser):
    markers = (("<|tool_call|>", False),)

    def parse_calls(self, text):
        try:
            items = json.loads(text)
            calls = [ToolCall(item["name"], _arguments(item.get("arguments", {}))) for item in items]
        except (ValueError, KeyError, TypeError):
            return None
        return calls or None


def _arguments(arguments) -> str:
    if not isinstance(arguments, dict | str):
        raise TypeError("arguments are an object")
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
