"""granite on the exact text Granite 3.x writes for tool calls (``<|tool_call|>`` and a JSON
list), fed in small pieces as the server streams it."""

import json

from engine.interfaces import ToolCall
from engine.plugins import load_plugins
from engine.testing.tool_parser import check_streamed, parse_in_pieces


def make():
    return load_plugins().get("tool_parsers", "granite")(None)


def parse(text: str, piece: int = 5):
    return parse_in_pieces(make(), text, piece)


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


def test_calls_stream_argument_by_argument():
    """The name first, then the arguments object's text as it arrives (its key order and
    spacing as written, whichever key comes first); a string of JSON decoded; no arguments
    ``{}``."""
    output = (
        ' <|tool_call|>[{"name": "get_weather",'
        ' "arguments": {"city": "Paris, \\"FR\\"", "days": [1, 2], "x": "}]\\\\"}},'
        ' {"arguments": {"zone":"UTC"}, "name": "get_time"},'
        ' {"name": "get_date", "arguments": "{\\"iso\\": true}"}, {"name": "ping"}]'
    )
    content, calls = check_streamed(make, output)
    assert content == " "
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris, \\"FR\\"", "days": [1, 2], "x": "}]\\\\"}'),
        ("get_time", '{"zone":"UTC"}'),
        ("get_date", '{"iso": true}'),
        ("ping", "{}"),
    ]
    assert json.loads(calls[0].arguments) == {"city": 'Paris, "FR"', "days": [1, 2], "x": "}]\\"}


def test_plain_answers_and_text_that_begins_no_call_are_content():
    assert parse("It is sunny in Paris.") == ("It is sunny in Paris.", [])
    for broken in (
        '<|tool_call|>[{"name": "get_wea',
        "<|tool_call|>not a list",
        '<|tool_call|>[{"name": 5}]',
    ):
        assert parse(broken) == (broken, [])


def test_a_call_cut_off_keeps_what_arrived():
    cut = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa'
    assert parse(cut) == ("", [ToolCall("get_weather", '{"city": "Pa')])
