"""``qwen3_coder``: Qwen3-Coder's XML tool calls (vLLM's name), as its chat template asks for
them::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are text; each becomes the type its parameter's JSON schema gives it (the request's
tools): integers, numbers, booleans and null as JSON reads them, objects and arrays as JSON
(or a Python literal), anything else, or a value that does not convert, as the string."""

from __future__ import annotations

import ast
import json
import re

from engine.interfaces import MarkedToolParser, ToolCall

HEAD = re.compile(r"\s*<tool_call>\s*<function=([^>\n]+)>")
PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
PARAMETER_END = "</parameter>"
TAIL = re.compile(r"\s*</function>\s*</tool_call>")


class Qwen3CoderToolParser(MarkedToolParser):
    """Streams each call's name once its ``<function=...>`` tag is complete, then its arguments
    object a parameter at a time (``{"city": "Paris"``, ``, "days": 3``, ``}``), as vLLM's does."""

    markers = (("<tool_call>", True),)
    anywhere = True
    needs_special_tokens = False  # <tool_call> is an added token that detokenization keeps

    def parse_calls(self, text):
        calls, end = self._scan(text)
        return calls if calls and end == len(text) else None

    def partial_calls(self, text):
        return self._scan(text)[0]

    def _scan(self, text: str) -> tuple[list[ToolCall], int | None]:
        """The calls begun in ``text``, each with the arguments its complete parameters give,
        and where the last complete call ends (None when one is still open)."""
        calls, at = [], 0
        while head := HEAD.match(text, at):
            name, at = head.group(1).strip(), head.end()
            items = []
            while (parameter := PARAMETER.match(text, at)) and (
                end := text.find(PARAMETER_END, parameter.end())
            ) != -1:  # find, not a lazy regex: the open value is scanned again on every feed
                items.append(self._item(name, parameter.group(1), text[parameter.end() : end]))
                at = end + len(PARAMETER_END)
            tail = TAIL.match(text, at)
            arguments = "{" + ", ".join(items) + ("}" if tail else "") if items or tail else ""
            calls.append(ToolCall(name, arguments))
            if tail is None:
                return calls, None
            at = tail.end()
        return calls, at

    def _item(self, name: str, key: str, raw: str) -> str:
        """One parameter as the JSON text of an object member, its value typed by the schema."""
        properties = ((self.tools.get(name) or {}).get("parameters") or {}).get("properties") or {}
        key = key.strip()
        value = typed(raw.removeprefix("\n").removesuffix("\n"), properties.get(key) or {})
        return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


def typed(value: str, schema: dict):
    """``value`` as the type ``schema`` gives (its ``type``, or the first of a list of types)."""
    kind = schema.get("type")
    kind = next((k for k in kind if k != "null"), "string") if isinstance(kind, list) else kind
    if value.strip().lower() == "null" and kind != "string":
        return None
    try:
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            number = float(value.strip())
            return (
                int(number)
                if number.is_integer() and "." not in value and "e" not in value.lower()
                else number
            )
        if kind == "boolean":
            return {"true": True, "false": False}[value.strip().lower()]
        if kind in ("object", "array"):
            try:
                return json.loads(value)
            except ValueError:
                return ast.literal_eval(value.strip())
    except (ValueError, KeyError, SyntaxError):
        pass
    return value
