"""The llama3_json, mistral and pythonic tool parsers on whole outputs, streamed in every
split into two pieces and token by token: content, calls, and what does not parse given back."""

from __future__ import annotations

import json

import pytest

from engine.interfaces import ToolCall
from engine_server.tool_parsers import Llama3JsonToolParser, MistralToolParser, PythonicToolParser

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "days": 3}))
TIME = ToolCall("get_time", json.dumps({}))

CASES = [
    (
        Llama3JsonToolParser,
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        "",
        [WEATHER],
    ),
    (
        Llama3JsonToolParser,
        (
            '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}; '
            '{"name": "get_time", "parameters": {}}'
        ),
        "",
        [WEATHER, TIME],
    ),
    (Llama3JsonToolParser, "Paris is sunny {not a call}", "Paris is sunny {not a call}", []),
    (Llama3JsonToolParser, '  {"oops": 1}', '  {"oops": 1}', []),
    (
        MistralToolParser,
        (
            'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
            '"days": 3}}, {"name": "get_time", "arguments": {}}]'
        ),
        "Let me check.",
        [WEATHER, TIME],
    ),
    (
        MistralToolParser,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [WEATHER, TIME],
    ),
    (MistralToolParser, "No tools [TOOL] needed.", "No tools [TOOL] needed.", []),
    (MistralToolParser, "[TOOL_CALLS]broken", "[TOOL_CALLS]broken", []),
    (PythonicToolParser, '[get_weather(city="Paris", days=3), get_time()]', "", [WEATHER, TIME]),
    (PythonicToolParser, '<|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>', "", [WEATHER]),
    (PythonicToolParser, "[1, 2] is a list", "[1, 2] is a list", []),
    (PythonicToolParser, "Sure: [get_time()]", "Sure: [get_time()]", []),
]


def run(parser_cls, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    parser = parser_cls(tokenizer=None)
    content, calls = [], []
    for piece in pieces:
        text, new = parser.feed(piece)
        content.append(text)
        calls += new
    text, new = parser.finish()
    return "".join(content) + text, calls + new


def _normalized(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("parser_cls", "output", "content", "calls"), CASES)
def test_whole_split_and_token_by_token(parser_cls, output, content, calls):
    splits = [[output], list(output)] + [[output[:i], output[i:]] for i in range(1, len(output))]
    for pieces in splits:
        got_content, got_calls = run(parser_cls, pieces)
        assert got_content == content, pieces
        assert _normalized(got_calls) == _normalized(calls), pieces


def test_content_streams_before_the_marker():
    parser = MistralToolParser(tokenizer=None)
    assert parser.feed("Hello there, ")[0] == "Hello there, "
    assert parser.feed("[TOOL")[0] == ""  # may still become the marker
    assert parser.feed("S] no")[0] == "[TOOLS] no"


@pytest.mark.parametrize("parser_cls", [Llama3JsonToolParser, MistralToolParser, PythonicToolParser])
def test_system_prompt_names_every_tool(parser_cls):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert "get_weather" in parser_cls(None).system_prompt(tools)
    assert parser_cls.needs_special_tokens
