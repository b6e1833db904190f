"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) driven by the official
`anthropic` SDK against a real `engine serve`: its answers equal the chat route's for the same
conversation (greedy), stop sequences / max_tokens / tool use give Anthropic's stop reasons, a
stream's events build the same message, tokens are counted as the prompt is built, and bad
input gets an Anthropic-shaped 4xx without disturbing the server."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import pytest

from tests.serving import API_KEY, serve

SERVE_ARGS = ("--dtype", "float32", "--num-blocks", "256", "--block-size", "16", "--max-model-len", "512")
SYSTEM = "You are a terse assistant."
TURNS = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And another one?"},
]
WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"}, "unit": {"enum": ["c", "f"]}},
}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    }
]
# sampling fields this SDK version no longer spells, as older SDKs and raw clients send them
GREEDY = {"temperature": 0}
RAW_EVENTS = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serve(tiny_llama[0], *SERVE_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(server):
    return server.model()


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_greedy_message_equals_chat_completion(server, client, model):
    """System + multi-turn, string or text-block content: the chat route's greedy answer,
    with its token counts; the SDK reaches the route with x-api-key and anthropic-version."""
    reply = client.messages.create(
        model=model, max_tokens=24, extra_body=GREEDY, system=SYSTEM, messages=TURNS
    )
    chat = server.openai().chat.completions.create(
        model=model, max_tokens=24, temperature=0, messages=[{"role": "system", "content": SYSTEM}, *TURNS]
    )
    choice = chat.choices[0]
    assert reply.type == "message" and reply.role == "assistant" and reply.model == model
    assert reply.id.startswith("msg_")
    assert _text(reply) == choice.message.content
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    blocks = client.messages.create(
        model=model,
        max_tokens=24,
        extra_body=GREEDY,
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in TURNS],
    )
    assert _text(blocks) == _text(reply)


def test_stop_sequence_and_max_tokens_stop_reasons(client, model):
    turns = [{"role": "user", "content": "Count to ten."}]
    long = client.messages.create(model=model, max_tokens=40, extra_body=GREEDY, messages=turns)
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 40
    text = _text(long)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.messages.create(
        model=model, max_tokens=40, extra_body=GREEDY, messages=turns, stop_sequences=[stop]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(cut) == text[: text.index(stop)]


def test_stream_events_build_the_same_message(client, model):
    kwargs = dict(model=model, max_tokens=30, extra_body=GREEDY, system=SYSTEM, messages=TURNS)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [e.type for e in stream if e.type in RAW_EVENTS]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    body = kinds[1:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}
    assert _text(final) == _text(whole) and final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 30
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_concurrent_streams_each_end_whole(client, model):
    def one(i: int):
        turns = [{"role": "user", "content": f"Tell me about the number {i}."}]
        with client.messages.stream(model=model, max_tokens=20, messages=turns, extra_body=GREEDY) as stream:
            kinds = [e.type for e in stream if e.type in RAW_EVENTS]
            return kinds[-1], stream.get_final_message()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for last, message in results:
        assert last == "message_stop" and message.stop_reason == "max_tokens"
        assert message.usage.output_tokens == 20 and _text(message)


def test_prefilled_assistant_turn_is_continued(server, client, model):
    """A last assistant turn is continued, as the chat route's continue_final_message."""
    turns = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello"}]
    reply = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY, messages=turns)
    chat = server.openai().chat.completions.create(
        model=model,
        max_tokens=12,
        temperature=0,
        messages=turns,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert _text(reply) == chat.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice", [{"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}]
)
def test_forced_tool_use_gives_a_tool_use_block(client, model, choice, stream):
    kwargs = dict(
        model=model,
        max_tokens=80,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        tool_choice=choice,
    )
    if stream:
        with client.messages.stream(**kwargs) as events:
            deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
            reply = events.get_final_message()
        assert set(deltas) == {"input_json_delta"}
    else:
        reply = client.messages.create(**kwargs)
    assert reply.stop_reason == "tool_use"
    calls = [block for block in reply.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id
    jsonschema.validate(calls[0].input, WEATHER)


def test_tool_history_equals_chat_completion(server, client, model):
    """tool_use and tool_result blocks are the chat route's tool calls and tool messages."""
    reply = client.messages.create(
        model=model,
        max_tokens=16,
        extra_body=GREEDY,
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "call_1",
                        "name": "get_weather",
                        "input": {"city": "Paris", "unit": "c"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "21 C"}],
            },
        ],
    )
    chat = server.openai().chat.completions.create(
        model=model,
        max_tokens=16,
        temperature=0,
        tools=OPENAI_TOOLS,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": json.dumps({"city": "Paris", "unit": "c"}),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        ],
    )
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert _text(reply) == (chat.choices[0].message.content or "")


def test_count_tokens_equals_the_prompt(client, model):
    for kwargs in (dict(system=SYSTEM, messages=TURNS), dict(messages=TURNS[:1], tools=TOOLS)):
        counted = client.messages.count_tokens(model=model, **kwargs)
        reply = client.messages.create(model=model, max_tokens=1, **kwargs)
        assert counted.input_tokens == reply.usage.input_tokens > 0


def test_messages_show_in_openapi_and_metrics(server, client, model):
    before = server.metric("vllm:prompt_tokens_total")
    reply = client.messages.create(model=model, max_tokens=4, messages=TURNS[:1])
    assert server.metric("vllm:prompt_tokens_total") == before + reply.usage.input_tokens
    with server.http() as http:
        spec = http.get("/openapi.json").json()
    paths = spec["paths"]
    declared = {"$ref": "#/components/schemas/AnthropicMessage", "components": spec["components"]}
    for extra in ({}, {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}}):
        raw = client.messages.with_raw_response.create(
            model=model, max_tokens=80, messages=TURNS[:1], **extra
        )
        jsonschema.validate(json.loads(raw.text()), declared)  # the answer as sent, not as the SDK reads it
    assert paths["/v1/messages"]["post"]["responses"]["200"]["content"]["application/json"]["schema"][
        "$ref"
    ].endswith("/AnthropicMessage")
    assert (
        paths["/v1/messages/count_tokens"]["post"]["responses"]["4XX"]["description"]
        == "Anthropic-shaped error"
    )


def test_disconnect_aborts_the_stream(server, model):
    body = {"model": model, "max_tokens": 450, "stream": True, "messages": TURNS[:1]}
    before = server.metric("vllm:generation_tokens_total")
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream(
        "POST", f"{server.url}/v1/messages", json=body, headers=headers, timeout=60
    ) as response:
        for line in response.iter_lines():
            if line == "event: content_block_delta":
                break
    server.wait_for_metric("vllm:num_requests_running", lambda running: running == 0)
    assert server.metric("vllm:generation_tokens_total") - before < 450


BAD = [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "no-such-model"}, 404, "not_found_error", "no-such-model"),
    ({"messages": []}, 400, "invalid_request_error", "at least one message"),
    ({"messages": [{"role": "assistant", "content": "Hi"}]}, 400, "invalid_request_error", "user role"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, 400, "invalid_request_error", "role"),
    (
        {"tools": [{"name": "f", "input_schema": {"type": "no-such-type"}}]},
        400,
        "invalid_request_error",
        "tools[0].input_schema",
    ),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error", "nope"),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
                    ],
                }
            ]
        },
        400,
        "invalid_request_error",
        "this model takes no images",
    ),
    (
        {
            "messages": [
                TURNS[0],
                {"role": "assistant", "content": [{"type": "tool_use", "id": "c", "name": "f"}]},
            ]
        },
        400,
        "invalid_request_error",
        "messages[1].content[0]",
    ),
    ({"system": [{"type": "image", "source": {}}]}, 400, "invalid_request_error", "system[0]: image"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"max_tokens": 4096}, 400, "invalid_request_error", "max"),
]


def test_bad_input_gets_anthropic_errors_and_the_server_keeps_serving(server, client, model):
    good = {"model": model, "max_tokens": 4, "messages": TURNS[:1]}
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        for change, status, kind, words in BAD:
            body = {k: v for k, v in {**good, **change}.items() if v is not None}
            for route in ("/v1/messages", "/v1/messages/count_tokens"):
                if route.endswith("count_tokens"):
                    if set(change) & {"max_tokens", "temperature"}:
                        continue
                    body = {k: v for k, v in body.items() if k != "max_tokens"}
                response = http.post(route, json=body)
                error = response.json()
                assert response.status_code == status, (route, change, error)
                assert error["type"] == "error" and error["error"]["type"] == kind, (route, change, error)
                assert words in error["error"]["message"], (route, change, error)
        assert (
            http.post("/v1/messages", content=b"{not json").json()["error"]["type"] == "invalid_request_error"
        )
        assert http.get("/v1/messages").json()["error"]["type"] == "invalid_request_error"  # 405
        plain = http.post("/v1/messages", content=json.dumps(good), headers={"Content-Type": "text/plain"})
        assert plain.status_code == 415 and plain.json()["type"] == "error"  # the guard's refusal
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(
            model=model,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "http://localhost/a.png"}}
                    ],
                }
            ],
        )
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**{**good, "model": "no-such-model"})
    assert client.messages.create(**good).stop_reason in ("max_tokens", "end_turn")


def test_api_key_from_x_api_key_or_bearer(server, model):
    good = {"model": model, "max_tokens": 2, "messages": TURNS[:1]}
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(**good)
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=API_KEY, max_retries=0)
    assert bearer.messages.create(**good).usage.output_tokens >= 1
    response = httpx.post(f"{server.url}/v1/messages", json=good)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    openai_shaped = httpx.post(f"{server.url}/v1/completions", json={}).json()  # other routes keep theirs
    assert "type" not in openai_shaped and openai_shaped["error"]["code"] == "invalid_api_key"


@pytest.fixture(scope="module")
def narrow_server(tiny_llama):
    """A server with a reasoning parser, one sequence at a time and room for one more queued."""
    args = ("--reasoning-parser", "deepseek_r1", "--max-num-seqs", "1", "--max-queued-requests", "1")
    with serve(tiny_llama[0], *SERVE_ARGS, *args, api_key=None) as s:
        yield s


def test_reasoning_parser_gives_thinking_blocks(narrow_server):
    """With --reasoning-parser, the chat route's reasoning_content is a thinking block (here
    all of the output: deepseek_r1 reads it as reasoning until a </think> the random model
    never writes), streamed as thinking_delta events."""
    server = narrow_server
    model = server.model()
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    kwargs = dict(
        model=model,
        max_tokens=20,
        messages=TURNS,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body=GREEDY,
    )
    reply = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        deltas = {e.delta.type for e in stream if e.type == "content_block_delta"}
        streamed = stream.get_final_message()
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": model,
            "max_tokens": 20,
            "temperature": 0,
            "messages": TURNS,
            "chat_template_kwargs": {"enable_thinking": True},
        },
    ).json()
    thought = chat["choices"][0]["message"]["reasoning_content"]
    assert (
        thought and [b.type for b in reply.content] == ["thinking"] and reply.content[0].thinking == thought
    )
    assert deltas == {"thinking_delta"} and streamed.content[0].thinking == thought


def test_admission_refusal_is_anthropic_overloaded(narrow_server):
    """A burst past one running and one queued request: the rest are refused as Anthropic
    refuses by load (529 overloaded_error, the SDK's OverloadedError, with Retry-After);
    the admitted ones finish."""
    server = narrow_server
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    # greedy: every admitted request runs all 200 tokens (the random model writes no EOS in
    # them), so the burst always finds the one running and the one queued slot taken
    long = dict(model=server.model(), max_tokens=200, messages=TURNS[:1], extra_body=GREEDY)

    def one(_):
        try:
            return client.messages.create(**long)
        except anthropic.OverloadedError as exc:
            return exc

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    refused = [r for r in results if isinstance(r, anthropic.OverloadedError)]
    answered = [r for r in results if not isinstance(r, anthropic.OverloadedError)]
    assert refused and len(answered) >= 2
    for error in refused:
        assert error.status_code == 529 and error.body["error"]["type"] == "overloaded_error"
        assert error.response.headers["Retry-After"]
    assert all(message.usage.output_tokens == 200 for message in answered)
