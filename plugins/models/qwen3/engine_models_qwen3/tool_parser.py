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

CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderToolParser(MarkedToolParser):
    markers = (("<tool_call>", True),)
    anywhere = True
    needs_special_tokens = False  # <tool_call> is an added token that detokenization keeps

    def parse_calls(self, text):
        calls = [self._call(name.strip(), body) for name, body in CALL.findall(text)]
        if not calls or CALL.sub("", text).strip():
            return None
        return calls

    def _call(self, name: str, body: str) -> ToolCall:
        schema = (self.tools.get(name) or {}).get("parameters") or {}
        properties = schema.get("properties") or {}
        arguments = {}
        for key, raw in PARAMETER.findall(body):
            key = key.strip()
            value = raw.removeprefix("\n").removesuffix("\n")
            arguments[key] = typed(value, properties.get(key) or {})
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


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
