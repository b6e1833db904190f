"""Through a real server and the openai SDK, on a tiny random model whose tokenizer has
<think> and </think> (as DeepSeek-R1's and Qwen3's do), served with --reasoning-parser
deepseek_r1 and --tool-call-parser qwen3_coder: a json_schema request's reasoning is free and
its content follows the schema (the grammar waits for </think>); structural tags in both of
vLLM's shapes, and their bad shapes answered 400; qwen3_coder calls, streamed and not.

A logit bias on </think> (the random model would not write it) decides where the reasoning
ends; after it the grammar's mask holds, whatever the bias."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import TINY_LLAMA
from tests.serving import serve, streamed_calls

SERVE_ARGS = ("--dtype", "float32", "--num-blocks", "256", "--block-size", "16", "--max-model-len", "512")
FORECAST = {  # no free strings: a biased </think> could otherwise fill them
    "type": "object",
    "additionalProperties": False,
    "required": ["unit", "days"],
    "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
}
MESSAGES = [{"role": "user", "content": "Forecast for Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]
QWEN3_CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def think_model(tmp_path_factory, tiny_llama):
    """(folder, tokenizer): a tiny random Llama with SmolLM2's tokenizer plus the markers."""
    from transformers import AutoTokenizer

    from engine.testing import reference

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama[0])
    tokenizer.add_tokens(["<think>", "</think>"])
    folder = str(tmp_path_factory.mktemp("tiny-think"))
    reference.tiny_checkpoint(
        folder, "LlamaForCausalLM", {**TINY_LLAMA, "vocab_size": 49216}, tokenizer=tokenizer
    )
    return folder, tokenizer


@pytest.fixture(scope="module")
def server(think_model):
    args = ("--reasoning-parser", "deepseek_r1", "--tool-call-parser", "qwen3_coder")
    with serve(think_model[0], *SERVE_ARGS, *args, api_key=None) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def ends_thinking(think_model, bias: float) -> dict:
    return {str(think_model[1].convert_tokens_to_ids("</think>")): bias}


def test_reasoning_is_free_and_the_content_follows_the_schema(client, think_model):
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": FORECAST}},
        logit_bias=ends_thinking(think_model, 8),
        n=4,
        seed=0,
        max_tokens=200,
    )
    thoughts = []
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), FORECAST)
        thoughts.append(choice.message.reasoning_content or "")
    assert any(t.strip() and not t.lstrip().startswith("{") for t in thoughts), thoughts


def test_structural_tags_in_both_shapes(client, think_model):
    model = client.models.list().data[0].id
    tag = {"begin": "<forecast>", "end": "</forecast>"}
    newer = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "Here: "},
                {"type": "tag", **tag, "content": {"type": "json_schema", "json_schema": FORECAST}},
            ],
        },
    }
    reply = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        response_format=newer,
        logit_bias=ends_thinking(think_model, 100),
        max_tokens=60,
    )
    content = reply.choices[0].message.content
    match = re.fullmatch(r"Here: <forecast>(.*)</forecast>", content, re.DOTALL)
    assert match, content
    jsonschema.validate(json.loads(match.group(1)), FORECAST)
    # vLLM's older shape, as structured_outputs' JSON text: free text until the trigger, then
    # the tag; " forecast" (one token, biased as </think> is) makes the free text reach it
    older = {
        "type": "structural_tag",
        "structures": [{"begin": " forecast(", "schema": FORECAST, "end": ")"}],
        "triggers": [" forecast"],
    }
    (forecast,) = think_model[1].encode(" forecast", add_special_tokens=False)
    free = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        logit_bias={**ends_thinking(think_model, 100), str(forecast): 100},
        max_tokens=60,
        extra_body={"structured_outputs": {"structural_tag": json.dumps(older)}},
    )
    text = free.choices[0].message.content
    tags = re.findall(r" forecast\((.*?)\)", text)
    assert tags and text.count(" forecast") - len(tags) <= (free.choices[0].finish_reason == "length"), text
    for body in tags:
        jsonschema.validate(json.loads(body), FORECAST)


BAD_TAGS = [
    ({"type": "structural_tag"}, "needs a `format`"),
    (
        {"type": "structural_tag", "structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<b"]},
        "none of the triggers",
    ),
    ({"type": "structural_tag", "structures": [], "triggers": ["<a"]}, "structures must be"),
    (
        {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"type": 5}}},
        "invalid json schema",
    ),
    ({"type": "structural_tag", "format": {"type": "no-such-format"}}, "invalid grammar"),
]


@pytest.mark.parametrize(("response_format", "message"), BAD_TAGS)
def test_bad_structural_tags_are_400(server, response_format, message):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "response_format": response_format}
        reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400, reply.text
        assert message in reply.json()["error"]["message"]
        assert http.post("/v1/chat/completions", json={**body, "response_format": None}).status_code == 200


def test_qwen3_coder_calls_streamed_and_not(client, think_model):
    kwargs = dict(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=80,
        logit_bias=ends_thinking(think_model, 100),
        extra_body={"guided_regex": re.escape(QWEN3_CODER_CALL)},
    )
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    call = choice.message.tool_calls[0].function
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "days": 3})
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    (streamed,) = streamed_calls(chunks)  # a parameter at a time: {"city": ..., , "days": 3, }
    assert (streamed["name"], streamed["arguments"]) == (call.name, call.arguments)
    assert streamed["named_first"] and streamed["argument_deltas"] == 3
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
