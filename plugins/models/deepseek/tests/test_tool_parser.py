"""deepseek_v3 on the exact text DeepSeek-V3's chat template writes for tool calls, fed in
small pieces as the server streams it."""

import json

from engine.plugins import load_plugins
from engine.testing.tool_parser import parse_in_pieces

CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
OUTPUT = (
    "Checking both.<｜tool▁calls▁begin｜>"
    + CALL.format(name="get_weather", args='{"city": "Paris", "days": 3}')
    + "\n"
    + CALL.format(name="get_time", args='{"zone": "CET"}')
    + "<｜tool▁calls▁end｜>"
)


def parse(text: str, piece: int = 4):
    parser = load_plugins().get("tool_parsers", "deepseek_v3")(None)
    return parse_in_pieces(parser, text, piece)


def test_calls_after_content():
    content, calls = parse(OUTPUT)
    assert content == "Checking both."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_time", {"zone": "CET"}),
    ]


def test_broken_calls_are_given_back_as_content():
    text = (
        "<｜tool▁calls▁begin｜>" + CALL.format(name="get_weather", args='{"city": ') + "<｜tool▁calls▁end｜>"
    )
    content, calls = parse(text)
    assert calls == [] and content == text
