"""qwen3_coder on the exact text Qwen3-Coder's chat template asks for, fed in small pieces as
the server streams it: content before the call, each parameter converted by its schema."""

import json

from engine.interfaces import ToolCall
from engine.plugins import load_plugins
from engine.testing.tool_parser import check_streamed, parse_in_pieces

TOOLS = {
    "get_weather": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "ratio": {"type": "number"},
                "hours": {"type": "array"},
                "where": {"type": ["object", "null"]},
                "code": {"type": "string"},
            },
        },
    },
    "get_time": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
OUTPUT = (
    "Let me check.\n"
    "<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n"
    "<parameter=metric>\ntrue\n</parameter>\n"
    "<parameter=ratio>\n0.5\n</parameter>\n"
    "<parameter=hours>\n[9, 12]\n</parameter>\n"
    "<parameter=where>\n{'lat': 1.5}\n</parameter>\n"
    "<parameter=code>\nx = 1\nprint(x)\n</parameter>\n"
    "</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
)


def make():
    parser = load_plugins().get("tool_parsers", "qwen3_coder")(None)
    parser.use_tools(TOOLS)
    return parser


def parse(text: str, piece: int = 3):
    return parse_in_pieces(make(), text, piece)


def test_calls_with_typed_parameters():
    content, calls = parse(OUTPUT)
    assert content == "Let me check.\n"
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {
        "city": "New York",
        "days": 3,
        "metric": True,
        "ratio": 0.5,
        "hours": [9, 12],
        "where": {"lat": 1.5},
        "code": "x = 1\nprint(x)",
    }
    assert json.loads(calls[1].arguments) == {}


def test_values_that_do_not_convert_stay_text_and_unknown_tools_are_strings():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>"
        "<tool_call>\n<function=other>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
    )
    content, calls = parse(text)
    assert content == ""
    assert json.loads(calls[0].arguments) == {"days": "three"}
    assert (calls[1].name, json.loads(calls[1].arguments)) == ("other", {"n": "5"})


def test_text_that_only_looks_like_a_call_is_content():
    text = "Use <tool_call> tags like <function=x> to call."
    assert parse(text) == (text, [])


def test_calls_stream_a_parameter_at_a_time():
    """The name once its tag is complete, then the arguments object a parameter at a time:
    the same calls however the text is split, the JSON text exactly vLLM's."""
    content, calls = check_streamed(make, OUTPUT)
    assert content == "Let me check.\n"
    assert calls[0].arguments == json.dumps(json.loads(calls[0].arguments), ensure_ascii=False)
    assert calls[1] == ToolCall("get_time", "{}")


def test_a_call_cut_off_keeps_its_complete_parameters():
    cut = OUTPUT[: OUTPUT.index("<parameter=metric>") + 20]
    assert parse(cut) == ("Let me check.\n", [ToolCall("get_weather", '{"city": "New York", "days": 3')])
