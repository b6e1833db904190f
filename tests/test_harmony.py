"""gpt-oss's harmony format: prompts rendered with ``openai-harmony``, output read back by the
``openai_gptoss`` reasoning parser and the ``openai`` tool parser (checked against
``openai-harmony``'s own parse of the same tokens), and a real ``engine serve`` of a tiny
gpt-oss checkpoint with gpt-oss's tokenizer, driven by the ``openai`` SDK. The checkpoint is
a bigram model by construction (tests/harmony_checkpoint.py) that answers every prompt with
a harmony call of ``get_weather``, so the server's whole path (harmony prompt, stop at
``<|call|>``, parsing) runs on real generated tokens."""

from __future__ import annotations

import argparse
import json

import msgspec
import openai
import pytest

from engine.entrypoints.harmony import encoding
from engine.plugins import load_plugins
from engine_server.errors import APIError
from engine_server.harmony import render_chat
from engine_server.harmony_parsers import HarmonyReasoningParser, HarmonyToolParser
from engine_server.responses_input import chat_messages, input_items
from engine_server.serve import parsers
from engine_server.tools import ChatOutput, HermesToolParser
from tests.harmony_checkpoint import save_bigram_gpt_oss, save_o200k_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
CALL_HEADER_FIRST = (
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
)
THINK = "<|channel|>analysis<|message|>The user wants the weather. I will call the tool.<|end|>"
OUTPUTS = {  # what gpt-oss writes after the prompt's <|start|>assistant
    "answer": THINK + "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>",
    "call": THINK + "<|start|>assistant" + CALL,
    "recipient_first": THINK + CALL_HEADER_FIRST + '{"city":"Oslo"}<|call|>',
    "preamble_then_call": "<|channel|>commentary<|message|>Checking the weather now.<|end|><|start|>assistant"
    + CALL,
    "final_only": "<|channel|>final<|message|>Hello there!<|return|>",
}


def _expected(tokens: list[int]) -> dict:
    """openai-harmony's own reading of the tokens, in chat-message terms."""
    from openai_harmony import Role

    reasoning, content, calls = [], [], []
    for message in encoding().parse_messages_from_completion_tokens(tokens, Role.ASSISTANT):
        text = "".join(part.text for part in message.content)
        if message.recipient:
            calls.append((message.recipient.removeprefix("functions."), text))
        elif message.channel == "analysis":
            reasoning.append(text)
        else:
            content.append(text)
    return {"reasoning": "".join(reasoning), "content": "".join(content), "calls": calls}


def _pieces(name: str, stop_in_text: bool) -> tuple[list[int], list[str]]:
    """The output's tokens and their text one token at a time, as the server streams them;
    without ``stop_in_text`` the final stop token is not in the text (it ended generation)."""
    tokens = encoding().encode(OUTPUTS[name], allowed_special="all")
    shown = tokens if stop_in_text else tokens[:-1]
    return tokens, [encoding().decode([t]) for t in shown]


def _output(tool_parser: bool = True) -> ChatOutput:
    return ChatOutput(
        "auto", HarmonyToolParser(None) if tool_parser else None, True, HarmonyReasoningParser(None)
    )


@pytest.mark.parametrize("stop_in_text", [False, True])
@pytest.mark.parametrize("name", OUTPUTS)
def test_parsers_read_what_openai_harmony_reads(name, stop_in_text):
    tokens, pieces = _pieces(name, stop_in_text)
    expected = _expected(tokens)
    message = _output().message("".join(pieces))
    assert (message["reasoning_content"] or "") == expected["reasoning"]
    assert (message["content"] or "") == expected["content"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert calls == expected["calls"]

    streamed = _output()
    deltas = [d for piece in pieces for d in streamed.on_text(piece)] + streamed.on_finish()
    assert "".join(d.get("reasoning_content", "") for d in deltas) == expected["reasoning"]
    assert "".join(d.get("content", "") for d in deltas) == expected["content"]
    streamed_calls = [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d]
    assert [(f["name"], f["arguments"]) for f in streamed_calls] == expected["calls"]
    if expected["reasoning"]:  # the reasoning streams as it comes, not in one piece at the end
        assert sum(1 for d in deltas if "reasoning_content" in d) > 1


def test_tool_parser_alone_drops_the_analysis_and_finds_the_call():
    _, pieces = _pieces("call", stop_in_text=False)
    parser = HarmonyToolParser(None)
    content, calls = "", []
    for piece in pieces:
        text, found = parser.feed(piece)
        content, calls = content + text, calls + found
    text, found = parser.finish()
    assert content + text == "" and [(c.name, c.arguments) for c in calls + found] == [
        ("get_weather", '{"city":"Paris"}')
    ]


def test_output_cut_off_in_a_header_adds_nothing():
    message = _output().message("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>fin")
    assert message["reasoning_content"] == "Hm." and message["content"] == ""


def test_text_that_only_looks_like_a_marker_is_content():
    output = _output()
    message = output.message("<|channel|>final<|message|>a <|b| c <|end")
    assert message["content"] == "a <|b| c <|end" and "tool_calls" not in message


def test_render_puts_effort_instructions_tools_and_history_in_harmony():
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = encoding().decode(render_chat(messages, [WEATHER], {"reasoning_effort": "high"}))
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: high" in text
    assert "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n# Tools" in text
    assert "// Current weather in a city\ntype get_weather = (_: {\ncity: string,\n}) => any;" in text
    assert "## functions\n\nnamespace functions {" in text
    assert "<|start|>user<|message|>Weather in Paris?<|end|>" in text
    assert (
        CALL_HEADER_FIRST + '{"city":"Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
    ) in text
    assert text.endswith("<|start|>assistant")
    plain = encoding().decode(render_chat([{"role": "user", "content": "Hi"}], None, None))
    assert "Reasoning: medium" in plain and "developer" not in plain


@pytest.mark.parametrize(
    ("messages", "kwargs", "param"),
    [
        ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": ["oops"]}], None, "messages"),
        ([{"role": "robot", "content": "x"}], None, "messages"),
        ([{"role": "user", "content": "x"}], {"reasoning_effort": ["high"]}, "reasoning_effort"),
    ],
)
def test_what_harmony_cannot_render_is_a_400_naming_the_field(messages, kwargs, param):
    with pytest.raises(APIError) as caught:
        render_chat(messages, None, kwargs)
    assert caught.value.status == 400 and caught.value.param == param


def test_responses_reasoning_item_is_kept_before_the_pending_call():
    items = input_items(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Use it."}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]
    )
    messages = [msgspec.structs.asdict(m) for m in chat_messages(None, items)]
    text = encoding().decode(render_chat(messages, [WEATHER], None))
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>Use it.<|end|>"
        + CALL_HEADER_FIRST
        + '{"city":"Paris"}<|call|><|start|>functions.get_weather to=assistant'
    ) in text


@pytest.mark.parametrize(
    ("flags", "harmony", "expected"),
    [
        ((None, None), True, (HarmonyToolParser, HarmonyReasoningParser)),  # picked for gpt-oss
        (("openai", "openai_gptoss"), False, (HarmonyToolParser, HarmonyReasoningParser)),  # vLLM's names
        ((None, None), False, (HermesToolParser, None)),
    ],
)
def test_parsers_are_chosen_for_gpt_oss_and_by_vllm_names(flags, harmony, expected):
    args = argparse.Namespace(
        tool_call_parser=flags[0],
        reasoning_parser=flags[1],
        collect_detailed_traces=False,
        otlp_traces_endpoint=None,
    )
    assert parsers(args, load_plugins(["server"]), harmony) == expected


# ---- a real server -------------------------------------------------------------------------

SERVE_ARGS = (
    "--plugins",
    "models-gpt-oss,attention-torch,server",
    "--dtype",
    "float32",
    "--num-blocks",
    "64",
    "--block-size",
    "16",
    "--max-model-len",
    "512",
)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> str:
    """The tiny gpt-oss checkpoint's folder: it answers every prompt with CALL."""
    folder = str(tmp_path_factory.mktemp("gpt_oss_harmony"))
    save_o200k_tokenizer(folder)
    assistant = encoding().encode("assistant")
    save_bigram_gpt_oss(folder, assistant + encoding().encode(CALL, allowed_special="all"))
    return folder


@pytest.fixture(scope="module")
def server(gpt_oss):
    from tests.serving import serve

    with serve(gpt_oss, *SERVE_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_chat_tool_call_from_a_served_gpt_oss(server, client):
    response = client.chat.completions.create(
        model=server.model(),
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        temperature=0,
        max_tokens=40,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert response.usage.completion_tokens == len(encoding().encode(CALL, allowed_special="all"))


def test_chat_tool_call_streams(server, client):
    stream = client.chat.completions.create(
        model=server.model(),
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        temperature=0,
        max_tokens=40,
        stream=True,
    )
    chunks = list(stream)
    calls = [c for chunk in chunks for d in chunk.choices for c in (d.delta.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city":"Paris"}')]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_function_call_with_reasoning_effort(server, client):
    response = client.responses.create(
        model=server.model(),
        input="What is the weather in Paris?",
        instructions="Use the tools.",
        reasoning={"effort": "low"},
        tools=[{"type": "function", **WEATHER["function"]}],
        temperature=0,
        max_output_tokens=40,
    )
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert response.status == "completed"


def test_responses_function_call_streams(server, client):
    events = list(
        client.responses.create(
            model=server.model(),
            input="Weather?",
            tools=[{"type": "function", **WEATHER["function"]}],
            temperature=0,
            max_output_tokens=40,
            stream=True,
        )
    )
    done = [
        e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"
    ]
    assert [(i.name, json.loads(i.arguments)) for i in done] == [("get_weather", {"city": "Paris"})]
    assert events[-1].type == "response.completed"


def test_bad_reasoning_effort_is_a_400_naming_the_field(server, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=server.model(),
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={"chat_template_kwargs": {"reasoning_effort": "extreme"}},
        )
    assert caught.value.body["param"] == "reasoning_effort"


def test_anthropic_messages_tool_use(server):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0)
    message = client.messages.create(
        model=server.model(),
        max_tokens=40,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[
            {
                "name": "get_weather",
                "description": "Weather",
                "input_schema": WEATHER["function"]["parameters"],
            }
        ],
    )
    [block] = [b for b in message.content if b.type == "tool_use"]
    assert (
        block.name == "get_weather" and block.input == {"city": "Paris"} and message.stop_reason == "tool_use"
    )


def test_tokenize_renders_harmony_too(server):
    messages = [{"role": "user", "content": "Hi"}]
    with server.http() as http:
        answer = http.post("/tokenize", json={"messages": messages}).json()
    assert answer["tokens"] == render_chat(messages, None, None)


def test_offline_chat_renders_and_answers_as_the_server_does(gpt_oss, server, client):
    """LLM.chat on the gpt-oss checkpoint: the server's prompt (its /tokenize, and with tools
    the chat route's prompt length), the server's raw output (the same tokens completed with
    special tokens kept, ending at <|call|>), and so the call the chat route reads from it."""
    from engine import LLM, SamplingParams
    from engine.entrypoints.harmony import stop_token_ids

    llm = LLM(
        gpt_oss,
        plugins=["models-gpt-oss", "attention-torch"],
        dtype="float32",
        num_blocks=64,
        block_size=16,
        max_model_len=512,
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    effort = {"reasoning_effort": "low"}
    greedy = SamplingParams(temperature=0, max_tokens=40)
    [plain, with_tools] = [
        llm.chat(messages, greedy, chat_template_kwargs=effort, tools=tools)[0] for tools in (None, [WEATHER])
    ]
    with pytest.raises(ValueError, match="^add_generation_prompt: a harmony prompt always ends"):
        llm.chat(messages, greedy, add_generation_prompt=False)
    with server.http() as http:
        tokens = http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": effort}).json()
        body = {
            "prompt": plain.prompt_token_ids,
            "temperature": 0,
            "max_tokens": 40,
            "skip_special_tokens": False,
        }
        raw = http.post(
            "/v1/completions", json={"model": server.model(), **body, "stop_token_ids": stop_token_ids()}
        ).json()["choices"][0]
    assert plain.prompt_token_ids == tokens["tokens"]
    assert plain.outputs[0].text == raw["text"] == CALL  # ending at its <|call|>
    assert plain.outputs[0].finish_reason == raw["finish_reason"] == "stop"
    reply = client.chat.completions.create(
        model=server.model(),
        messages=messages,
        tools=[WEATHER],
        temperature=0,
        max_tokens=40,
        extra_body={"chat_template_kwargs": effort},
    )
    assert reply.usage.prompt_tokens == len(with_tools.prompt_token_ids) > len(plain.prompt_token_ids)
    [call] = reply.choices[0].message.tool_calls
    assert _expected(list(with_tools.outputs[0].token_ids))["calls"] == [
        (call.function.name, call.function.arguments)
    ]
