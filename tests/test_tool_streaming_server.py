"""Through a real server and the openai SDK, served with --tool-call-parser deepseek_v3 (its
markers are special tokens where DeepSeek's tokenizer has them): tool calls stream argument by
argument, the name first, and reassemble to exactly the calls the non-streamed answer gives
(the chat route's whole message for the same text, made in this process: generating it again
over the server would double the test's time). Without parallel calls, the second call and all
its argument deltas are dropped (the chat route's own output, fed as a stream is). A regex
makes the tiny random model write the calls; qwen3_coder's streaming over a server is in
tests/test_reasoning_structured_server.py, each parser's own in its plugin's tests."""

from __future__ import annotations

import json
import re

import pytest

from engine.plugins import load_plugins
from engine_server.tools import ChatOutput
from tests.serving import serve, streamed_calls

SERVE_ARGS = ("--dtype", "float32", "--num-blocks", "256", "--block-size", "16", "--max-model-len", "512")
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time")
]
CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
EXPECTED = [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"zone": "CET"}')]
ONE_CALL = "Checking.<｜tool▁calls▁begin｜>" + CALL.format(*EXPECTED[0])  # the model writes this
OUTPUT = ONE_CALL + CALL.format(*EXPECTED[1]) + "<｜tool▁calls▁end｜>"


@pytest.fixture(scope="module")
def client(tiny_llama):
    with serve(tiny_llama[0], *SERVE_ARGS, "--tool-call-parser", "deepseek_v3", api_key=None) as server:
        yield server.openai()


def test_deepseek_v3_calls_stream_argument_by_argument(client):
    kwargs = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Weather and time in Paris?"}],
        tools=TOOLS,
        max_tokens=300,
        extra_body={"guided_regex": re.escape(ONE_CALL)},
    )
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    calls = streamed_calls(chunks)
    whole = ChatOutput("auto", load_plugins().get("tool_parsers", "deepseek_v3")(None), True).message(
        ONE_CALL
    )
    assert [(c["name"], c["arguments"]) for c in calls] == EXPECTED[:1]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == EXPECTED[:1]
    assert calls[0]["named_first"] and calls[0]["argument_deltas"] > 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}


def test_without_parallel_calls_the_second_streamed_call_is_dropped_whole():
    parser = load_plugins().get("tool_parsers", "deepseek_v3")(None)
    output = ChatOutput("auto", parser, parallel=False)
    deltas = [d for at in range(len(OUTPUT)) for d in output.on_text(OUTPUT[at])] + output.on_finish()
    calls = [call for d in deltas for call in d.get("tool_calls", ())]
    assert {call["index"] for call in calls} == {0} and calls[0]["function"]["name"] == "get_weather"
    assert "".join(call["function"]["arguments"] for call in calls) == EXPECTED[0][1]
    whole = ChatOutput("auto", load_plugins().get("tool_parsers", "deepseek_v3")(None), parallel=False)
    assert [c["function"] for c in whole.message(OUTPUT)["tool_calls"]] == [
        {"name": "get_weather", "arguments": EXPECTED[0][1]}
    ]
