"""Structured outputs and tool calling through the server with the official openai client:
response_format, vLLM's structured_outputs / guided_* fields, tool_choice required / named
/ auto (Hermes parser), streaming and not; bad specs answered 400 without side effects;
a schema that is slow to compile does not hold up other requests."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import pytest

from tests.serving import serve

WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"}, "unit": {"enum": ["c", "f"]}},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "required": ["zone"],
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
            },
        },
    },
]
PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags"],
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
}
SLOW_SCHEMA = {
    "type": "object",
    "properties": {
        f"k{i}": {
            "type": "object",
            "properties": {f"j{j}": {"type": "string", "pattern": "[a-z]{2,9}"} for j in range(30)},
        }
        for i in range(60)
    },
}
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    # with an n-gram drafter: structured outputs and tool calls must hold with speculation too
    args = (
        "--dtype",
        "float32",
        "--num-blocks",
        "512",
        "--block-size",
        "16",
        "--max-model-len",
        "512",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3}',
    )
    with serve(tiny_llama[0], *args, api_key=None) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_response_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, n=8, temperature=1.0, seed=1, max_tokens=120, response_format=fmt
    )
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.finish_reason == "stop"
    streamed = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        temperature=1.0,
        seed=2,
        max_tokens=120,
        response_format=fmt,
        stream=True,
    )
    jsonschema.validate(
        json.loads("".join(c.choices[0].delta.content or "" for c in streamed if c.choices)), PERSON
    )
    anything = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        temperature=0.7,
        seed=3,
        max_tokens=200,
        response_format={"type": "json_object"},
    )
    if anything.choices[0].finish_reason == "stop":
        json.loads(anything.choices[0].message.content)


def test_vllm_structured_output_fields(client):
    model = client.models.list().data[0].id
    regex = r"[A-Z]{2}-\d{3}"
    for extra in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        out = client.completions.create(
            model=model, prompt="Code:", n=6, temperature=1.0, seed=4, max_tokens=20, extra_body=extra
        )
        assert all(re.fullmatch(regex, c.text) for c in out.choices), [c.text for c in out.choices]
    out = client.completions.create(
        model=model,
        prompt="Pick:",
        n=6,
        temperature=1.0,
        seed=5,
        max_tokens=10,
        extra_body={"guided_choice": ["alpha", "beta gamma"]},
    )
    assert {c.text for c in out.choices} <= {"alpha", "beta gamma"}
    out = client.completions.create(
        model=model,
        prompt="Sum:",
        n=4,
        temperature=1.0,
        seed=6,
        max_tokens=20,
        extra_body={"guided_grammar": 'root ::= [1-9] " + " [1-9] " = " [0-9]+'},
    )
    assert all(re.fullmatch(r"[1-9] \+ [1-9] = \d+", c.text) for c in out.choices)
    out = client.completions.create(
        model=model,
        prompt="JSON:",
        temperature=1.0,
        seed=7,
        max_tokens=120,
        extra_body={"guided_json": PERSON},
    )
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_calls_validate(client, stream):
    model = client.models.list().data[0].id
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for seed in range(3):
            # one call each: a random model under the parallel-calls grammar may open call after
            # call until max_tokens, whichever sampler draws the seed's tokens
            kwargs = dict(
                model=model,
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice=choice,
                temperature=1.0,
                seed=seed,
                max_tokens=150,
                parallel_tool_calls=False,
            )
            if stream:
                calls = {}
                finish = None
                for chunk in client.chat.completions.create(stream=True, **kwargs):
                    for delta in chunk.choices[0].delta.tool_calls or []:
                        entry = calls.setdefault(delta.index, {"name": None, "arguments": ""})
                        if delta.function.name:
                            entry["name"] = delta.function.name
                        entry["arguments"] += delta.function.arguments or ""
                    finish = chunk.choices[0].finish_reason or finish
                calls = list(calls.values())
            else:
                message = client.chat.completions.create(**kwargs).choices[0].message
                calls = [
                    {"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls
                ]
            assert calls
            for call in calls:
                if isinstance(choice, dict):
                    assert call["name"] == "get_weather"
                jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_auto_tool_choice_parses_hermes_calls(client):
    model = client.models.list().data[0].id
    forced = re.escape(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    )
    reply = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=60,
        temperature=0,
        extra_body={"guided_regex": forced},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "c"}
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            tools=TOOLS,
            max_tokens=60,
            temperature=0,
            stream=True,
            extra_body={"guided_regex": forced},
        )
    )
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function.name == "get_weather"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


BAD = [
    ({"guided_json": {"type": "no-such-type"}}, "invalid json"),
    ({"guided_regex": "([a-z"}, "invalid regex"),
    ({"guided_grammar": "root ::= ???"}, "invalid grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "one structured-output constraint"),
    ({"structured_outputs": {"yaml": "x"}}, "structured_outputs.yaml"),
]


def test_bad_specs_are_400_and_harmless(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for extra, text in BAD:
            response = http.post(
                "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 5, **extra}
            )
            assert response.status_code == 400 and text in response.json()["error"]["message"], response.text
        for body, text in [
            (
                {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                "not among the tools",
            ),
            ({"tool_choice": "required"}, "needs at least one tool"),
            ({"response_format": {"type": "yaml"}}, "response_format.type"),
            (
                {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
                "invalid json",
            ),
        ]:
            response = http.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, **body})
            assert response.status_code == 400 and text in response.json()["error"]["message"], response.text
        for stream in (False, True):
            response = http.post(
                "/v1/completions",
                json={"model": model, "prompt": "x", "stream": stream, "guided_regex": "([a-z"},
            )
            assert response.status_code == 400
        ok = http.post(
            "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 5, "ignore_eos": True}
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5


def test_slow_schema_does_not_delay_unconstrained_requests(server):
    with httpx.Client(base_url=server.url, timeout=300) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        slow_done = {}

        def slow():
            started = time.monotonic()
            try:
                r = http.post(
                    "/v1/completions",
                    json={"model": model, "prompt": "x", "max_tokens": 5, "guided_json": SLOW_SCHEMA},
                )
                slow_done["status"] = r.status_code
            except httpx.HTTPError as exc:
                slow_done["status"] = repr(exc)
            slow_done["seconds"] = time.monotonic() - started

        thread = threading.Thread(target=slow)
        thread.start()
        time.sleep(0.3)
        started = time.monotonic()
        for i in range(3):
            r = http.post(
                "/v1/completions",
                json={"model": model, "prompt": f"fast {i}", "max_tokens": 8, "ignore_eos": True},
            )
            assert r.status_code == 200
        fast_seconds = time.monotonic() - started
        slow_still_compiling = "status" not in slow_done
        thread.join(300)
    assert slow_done["status"] == 200 and slow_done["seconds"] > 2.0
    assert slow_still_compiling, "the unconstrained requests must finish while the slow grammar compiles"
    assert fast_seconds < 0.75 * slow_done["seconds"], (fast_seconds, slow_done)


def test_speculation_counters_in_metrics(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_draft_acceptance_rate",
        "vllm:spec_decode_mean_acceptance_length",
    ):
        assert name in text, name
    assert server.metric("vllm:spec_decode_num_draft_tokens_total") > 0
    per_pos = [
        line
        for line in text.splitlines()
        if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")
    ]
    assert 'position="0"' in per_pos[0]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in per_pos) == server.metric(
        "vllm:spec_decode_num_accepted_tokens_total"
    )
