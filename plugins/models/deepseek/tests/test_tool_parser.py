"""deepseek_v3 on the exact text DeepSeek-V3's chat template writes for tool calls, fed in
small pieces as the server streams it."""

import json

from engine.interfaces import ToolCall
from engine.plugins import load_plugins
from engine.testing.tool_parser import check_streamed, parse_in_pieces

CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
OUTPUT = (
    "Checking both.<｜tool▁calls▁begin｜>"
    + CALL.format(name="get_weather", args='{"city": "Paris", "days": 3}')
    + "\n"
    + CALL.format(name="get_time", args='{"zone": "CET"}')
    + "<｜tool▁calls▁end｜>"
)


def make():
    return load_plugins().get("tool_parsers", "deepseek_v3")(None)


def parse(text: str, piece: int = 4):
    return parse_in_pieces(make(), text, piece)


def test_calls_after_content():
    content, calls = parse(OUTPUT)
    assert content == "Checking both."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_time", {"zone": "CET"}),
    ]


def test_calls_stream_argument_by_argument():
    """The name first, then the JSON text as it arrives; the same calls however it is split,
    and exactly the JSON the model wrote."""
    content, calls = check_streamed(make, OUTPUT)
    assert content == "Checking both."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris", "days": 3}'),
        ("get_time", '{"zone": "CET"}'),
    ]


def test_text_that_begins_no_call_is_content_and_a_cut_off_call_keeps_what_arrived():
    prose = "<｜tool▁calls▁begin｜>no call after all"
    assert parse(prose) == (prose, [])
    cut = "<｜tool▁calls▁begin｜>" + CALL.format(name="get_weather", args='{"city": "Pa')[:-20]
    assert parse(cut) == ("", [ToolCall("get_weather", '{"city": "Pa')])
