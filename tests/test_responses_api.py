"""OpenAI's Responses API (/v1/responses) against a real server, spoken to with the official
`openai` client: the same output as the chat route for the same conversation (plain, with
instructions and items, continued with previous_response_id, round-tripping a function
call), the event stream, stored responses (GET, DELETE, input items, store=false, the
size and TTL bounds), text.format and function tools through the chat route's grammars, a
client leaving mid-stream, and bad input answered with OpenAI-shaped 4xx."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from engine_server.errors import APIError
from engine_server.responses_store import ResponseStore, StoredResponse
from tests.serving import serve

MODEL = "tiny"
STORE_SIZE = 8
RESPONSE_LIMIT = 32 * 1024  # --max-response-bytes: a long stream passes it, the other answers do not
SERVE_ARGS = (
    "--served-model-name",
    MODEL,
    "--dtype",
    "float32",
    "--num-blocks",
    "256",
    "--block-size",
    "16",
    "--max-model-len",
    "512",
    "--responses-store-size",
    str(STORE_SIZE),
    "--max-response-bytes",
    str(RESPONSE_LIMIT),
)
WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"}, "unit": {"enum": ["c", "f"]}},
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serve(tiny_llama[0], *SERVE_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def chat_text(client, messages, max_tokens=12, **kwargs) -> str:
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kwargs
    )
    return reply.choices[0].message.content


def test_text_equals_the_chat_route(server, client):
    before = server.metric("vllm:e2e_request_latency_seconds_count")
    response = client.responses.create(input="Tell me about robots.", **GREEDY)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.output_text == chat_text(client, [{"role": "user", "content": "Tell me about robots."}])
    [message] = response.output
    assert (
        message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    )
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and usage.output_tokens > 0
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    assert response.store and response.temperature == 0 and response.metadata == {}
    assert server.metric("vllm:e2e_request_latency_seconds_count") >= before + 2  # counted as any request


def test_instructions_and_items_equal_the_chat_route(client):
    items = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Hello, "}, {"type": "input_text", "text": "robot."}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Beep."}]},
        {"role": "developer", "content": "Answer in one line."},
        {"role": "user", "content": "What is your name?"},
    ]
    response = client.responses.create(
        input=items,
        instructions="You are a robot.",
        metadata={"k": "v"},
        reasoning={"effort": "low", "summary": "auto"},  # the template's reasoning_effort: unused by this one
        **GREEDY,
    )
    messages = [
        {"role": "system", "content": "You are a robot."},
        {"role": "user", "content": "Hello, robot."},
        {"role": "assistant", "content": "Beep."},
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "What is your name?"},
    ]
    assert response.output_text == chat_text(client, messages)
    assert response.instructions == "You are a robot." and response.metadata == {"k": "v"}
    assert response.reasoning.effort == "low"


def test_max_output_tokens_makes_it_incomplete(client):
    response = client.responses.create(input="Count to ten.", model=MODEL, temperature=0, max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and response.output[0].status == "incomplete"


TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def _collapsed(types: list[str]) -> list[str]:
    """The event types with runs of the same type (the deltas) as one."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def test_stream_event_sequence(client):
    whole = client.responses.create(input="Tell me a story.", **GREEDY)
    with client.responses.stream(input="Tell me a story.", **GREEDY) as stream:
        events = list(stream)
    final = events[-1].response  # response.incomplete's (get_final_response() wants a completed one)
    assert _collapsed([e.type for e in events]) == TEXT_EVENTS + [f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and events[-1].response.id == events[0].response.id
    raw = list(client.responses.create(input="Tell me a story.", stream=True, **GREEDY))
    assert [e.type for e in raw] == [e.type for e in events]
    # a streamed response is stored as any other
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_concurrent_streamed_conversations_keep_apart(server):
    """Four conversations at once, each streamed and then continued: every stream numbers its
    own events from 0, and each continuation reads its own conversation."""

    async def conversation(client, i: int) -> tuple[list[int], str, str]:
        async with client.responses.stream(input=f"Story number {i}.", **GREEDY) as stream:
            events = [event async for event in stream]
        first = events[-1].response
        second = await client.responses.create(previous_response_id=first.id, input="More.", **GREEDY)
        items = await client.responses.input_items.list(second.id)
        assert [i.content[0].text for i in items.data] == ["More."]
        return [e.sequence_number for e in events], first.id, second.previous_response_id

    async def main():
        client = server.openai(openai.AsyncOpenAI)
        return await asyncio.gather(*(conversation(client, i) for i in range(4)))

    for numbers, first_id, continued in asyncio.run(main()):
        assert numbers == list(range(len(numbers))) and continued == first_id


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(input="Hi there.", instructions="Be brief.", **GREEDY)
    second = client.responses.create(previous_response_id=first.id, input="And then?", **GREEDY)
    history = [
        {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]  # instructions are not carried over, as OpenAI's
    assert second.output_text == chat_text(client, history)
    assert second.previous_response_id == first.id
    third = client.responses.create(previous_response_id=second.id, input="Why?", **GREEDY)
    history += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Why?"}]
    assert third.output_text == chat_text(client, history)

    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = client.responses.input_items.list(second.id, order="asc")
    assert [(i.type, i.content[0].text) for i in items.data] == [("message", "And then?")]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(previous_response_id=first.id, input="Again?", **GREEDY)
    assert error.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)


def test_store_false_is_not_kept_and_the_store_is_bounded(client):
    unkept = client.responses.create(input="Forget me.", store=False, **GREEDY)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(previous_response_id=unkept.id, input="Hm?", **GREEDY)
    ids = [
        client.responses.create(input="x", model=MODEL, max_output_tokens=1).id for _ in range(STORE_SIZE + 1)
    ]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # the oldest went first
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


def test_store_forgets_after_its_ttl():
    now = [0.0]
    store = ResponseStore(size=2, ttl=10, clock=lambda: now[0])
    store.put(StoredResponse({"id": "resp_a"}, [], []))
    now[0] = 5
    store.put(StoredResponse({"id": "resp_b"}, [], []))
    now[0] = 12
    with pytest.raises(APIError, match="not found"):
        store.get("resp_a")
    assert store.get("resp_b").response["id"] == "resp_b"


def test_text_format_json_schema_and_json_object(client):
    person = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age"],
        "properties": {"name": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"}, "age": {"type": "integer"}},
    }
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": person, "strict": True}}
    response = client.responses.create(
        input="A person:", text=fmt, model=MODEL, temperature=0, max_output_tokens=80
    )
    jsonschema.validate(json.loads(response.output_text), person)
    assert response.text.format.type == "json_schema"
    anything = client.responses.create(
        input="JSON:",
        text={"format": {"type": "json_object"}},
        model=MODEL,
        temperature=0,
        max_output_tokens=200,
    )
    assert anything.text.format.type == "json_object"
    if anything.status == "completed":  # not cut off by max_output_tokens
        assert isinstance(json.loads(anything.output_text), dict)


def test_function_call_and_its_output_round_trip(client):
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    named = {"type": "function", "name": "get_weather"}
    response = client.responses.create(
        input=ask, tools=[TOOL], tool_choice=named, model=MODEL, max_output_tokens=60
    )
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    with client.responses.stream(
        input=ask,
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        model=MODEL,
        max_output_tokens=80,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert (
        "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    )
    [streamed] = [item for item in final.output if item.type == "function_call"]
    jsonschema.validate(json.loads(streamed.arguments), WEATHER)

    follow_up = ask + [
        call.model_dump(),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
    ]
    answer = client.responses.create(input=follow_up, tools=[TOOL], tool_choice="none", **GREEDY)
    messages = ask + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"},
    ]
    chat_tool = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}
    assert answer.output_text == chat_text(client, messages, tools=[chat_tool], tool_choice="none")


def test_client_leaving_a_stream_aborts_its_request(server):
    body = {"model": MODEL, "input": "Write a long story.", "stream": True, "max_output_tokens": 400}
    with server.http() as http, http.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert any("response.output_text.delta" in line for line in lines)
    server.wait_for_metric("vllm:num_requests_running", lambda running: running == 0, timeout=10)


def test_a_stream_that_fails_midway_ends_with_an_error_event(client):
    """Past --max-response-bytes the stream ends with an `error` event (OpenAI's shape, next
    sequence number, no response.completed); the response is not stored."""
    with client.responses.stream(input="Write a long story.", model=MODEL, max_output_tokens=400) as stream:
        events = list(stream)
    assert events[-1].type == "error" and events[-1].code == "response_too_large" and events[-1].message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.output_text.delta" in {e.type for e in events[:-1]}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(events[0].response.id)
    assert client.responses.create(input="Still there?", **GREEDY).status in ("completed", "incomplete")


BAD = [
    ({"model": MODEL}, 400, "input"),
    ({"model": "nope", "input": "x"}, 404, "model"),
    ({"model": MODEL, "input": ""}, 400, "input"),
    ({"model": MODEL, "input": [{"type": "web_search_call", "id": "x"}]}, 400, "input"),
    (
        {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        400,
        "input",
    ),
    ({"model": MODEL, "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input"),
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"model": MODEL, "input": "x", "tools": [{**TOOL, "parameters": {"type": "bogus"}}]}, 400, "tools"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
    (
        {"model": MODEL, "input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
        400,
        "tool_choice",
    ),
    ({"model": MODEL, "input": "x", "tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
    ({"model": MODEL, "input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text"),
    (
        {"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": 5}}},
        400,
        "text",
    ),
    # a schema the grammar compiler refuses: the engine's first answer, a 400 even for a stream
    (
        {
            "model": MODEL,
            "input": "x",
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "n",
                    "schema": {"type": "string", "pattern": "([a-z"},
                }
            },
        },
        400,
        None,
    ),
    ({"model": MODEL, "input": "x", "reasoning": {"effort": "maximal"}}, 400, "reasoning"),
    ({"model": MODEL, "input": "x", "background": True}, 400, "background"),
    ({"model": MODEL, "input": "x", "truncation": "auto"}, 400, "truncation"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 600}, 400, "max_output_tokens"),
    ({"model": MODEL, "input": "robot " * 600}, 400, "input"),
    ({"model": MODEL, "input": "x", "include": ["reasoning.encrypted_content"]}, 400, "include"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_is_an_openai_shaped_4xx(server, stream):
    with server.http() as http:
        for body, status, param in BAD:
            response = http.post("/v1/responses", json={**body, "stream": stream})
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert error["param"] == param and error["message"] and error["type"], (body, error)
        for path in ("/v1/responses/resp_nope", "/v1/responses/resp_nope/input_items"):
            error = http.get(path).json()["error"]
            assert error["code"] == "response_not_found"
        assert http.delete("/v1/responses/resp_nope").status_code == 404
        ok = http.post("/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] <= 2


def test_openapi_declares_the_routes(server):
    spec = httpx.get(f"{server.url}/openapi.json", headers=server.headers).json()
    assert "post" in spec["paths"]["/v1/responses"]
    assert set(spec["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    request = spec["components"]["schemas"]["ResponsesRequest"]
    assert request["properties"]["max_output_tokens"]["anyOf"][0]["maximum"] == 511
    assert request["additionalProperties"] is False and request["required"] == ["input"]
