"""granite on the exact text Granite 3.x writes for tool calls (``<|tool_call|>`` and a JSON
list), fed in small pieces as the server streams it."""

import json

from engine.plugins import load_plugins
from engine.testing.tool_parser import parse_in_pieces


def parse(text: str, piece: int = 5):
    parser = load_plugins().get("tool_parsers", "granite")(None)
    return parse_in_pieces(parser, text, piece)


def test_a_list_of_calls():
    output = (
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "UTC"}}]'
    )
    content, calls = parse(output)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "UTC"}),
    ]


def test_plain_answers_and_broken_calls_are_content():
    assert parse("It is sunny in Paris.") == ("It is sunny in Paris.", [])
    broken = '<|tool_call|>[{"name": "get_weather"'
    assert parse(broken) == (broken, [])
