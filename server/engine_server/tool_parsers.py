"""Tool-call formats beyond Hermes, with vLLM's parser names: ``llama3_json`` (Llama 3.x JSON
calls), ``mistral`` (``[TOOL_CALLS]`` calls) and ``pythonic`` (a Python list of calls, as
Llama 3.2/4 and ToolACE write them).

Each format announces calls with a marker (:class:`engine.interfaces.MarkedToolParser`).
"""

from __future__ import annotations

import ast
import json
import re

from engine.interfaces import MarkedToolParser, ToolCall


def _call(name, arguments) -> ToolCall:
    if not isinstance(name, str) or not isinstance(arguments, dict | str):
        raise TypeError("a call needs a name and an arguments object")
    return ToolCall(name, arguments if isinstance(arguments, str) else json.dumps(arguments))


def _signatures(tools: list[dict]) -> str:
    return "\n".join(json.dumps(t.get("function", t)) for t in tools)


class Llama3JsonToolParser(MarkedToolParser):
    """``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), several
    separated by ``;``."""

    markers = (("<|python_tag|>", False), ("{", True))

    def parse_calls(self, text):
        decoder, calls, at = json.JSONDecoder(), [], 0
        try:
            while at < len(text):
                data, end = decoder.raw_decode(text, at)
                calls.append(_call(data["name"], data.get("parameters", data.get("arguments", {}))))
                at = end
                while at < len(text) and text[at] in " \n\t;":
                    at += 1
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return calls or None

    def system_prompt(self, tools):
        return (
            "You have access to the following functions. To call a function, respond with only a JSON "
            'object of the form {"name": function name, "parameters": dictionary of argument name and its '
            f"value}}. Do not use variables.\n\n{_signatures(tools)}"
        )


class MistralToolParser(MarkedToolParser):
    """``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``, or (newer tokenizers)
    ``name[ARGS]{...}`` once per call."""

    markers = (("[TOOL_CALLS]", False),)
    anywhere = True
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")

    def parse_calls(self, text):
        try:
            if text.startswith("["):
                items = json.loads(text)
                return [_call(i["name"], i.get("arguments", {})) for i in items] or None
            calls, decoder = [], json.JSONDecoder()
            for part in filter(str.strip, text.split("[TOOL_CALLS]")):
                match = self._NAMED.match(part)
                arguments, _ = decoder.raw_decode(part, match.end())
                calls.append(_call(match.group(1), arguments))
            return calls or None
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def system_prompt(self, tools):
        return (
            "[AVAILABLE_TOOLS]" + json.dumps([t.get("function", t) for t in tools]) + "[/AVAILABLE_TOOLS] "
            'To call tools, answer with [TOOL_CALLS] followed by a JSON list of {"name": ..., '
            '"arguments": {...}} objects.'
        )


class PythonicToolParser(MarkedToolParser):
    """``[get_weather(city="Paris", days=3), other()]``: a Python list of calls with literal
    arguments (optionally inside ``<|python_start|>`` … ``<|python_end|>``)."""

    markers = (("<|python_start|>", True), ("[", True))

    def parse_calls(self, text):
        text = text.removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(text, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                    return None
                calls.append(_call(node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords}))
            return calls
        except (SyntaxError, ValueError, TypeError):
            return None

    def system_prompt(self, tools):
        return (
            "You can call functions. To call them, respond with only a Python list of calls with keyword "
            'arguments, e.g. [func_name(param="value", other=2)]. Available functions:\n'
            f"{_signatures(tools)}"
        )
