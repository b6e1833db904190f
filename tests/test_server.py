"""The OpenAI-compatible server, started for real and spoken to over HTTP with the official
`openai` client: completions and chat (streaming and not), concurrency, disconnects, the
utility routes, metrics, and every bad-input case answered with an OpenAI-shaped 4xx."""

from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest

from engine import LLM, SamplingParams
from tests.serving import serve

SERVE_ARGS = (
    "--served-model-name",
    "tiny-llama",
    "--dtype",
    "float32",
    "--num-blocks",
    "256",
    "--block-size",
    "16",
    "--max-model-len",
    "512",
)


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serve(tiny_llama[0], *SERVE_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(tiny_llama[0], dtype="float32", num_blocks=256, block_size=16, max_model_len=512)


MESSAGES = [{"role": "user", "content": "Tell me a short story about a robot."}]


def test_echo_with_logprobs_returns_the_prompts_logprobs(server, offline):
    """What lm-eval's loglikelihood reads: echo + logprobs give every prompt token's log-prob
    (the first null), then the generated one; prompt_logprobs gives vLLM's per-position dicts."""
    ids = offline.tokenizer.encode("The robot said hello to the")
    expected = offline.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    )[0].prompt_logprobs
    client = server.openai()
    for stream in (False, True):
        response = client.completions.create(
            model="tiny-llama", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True, stream=stream
        )
        chunks = list(response) if stream else [response]
        token_logprobs = [
            x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs
        ]
        assert len(token_logprobs) == len(ids) + 1 and token_logprobs[0] is None
        for position, got in enumerate(token_logprobs[1 : len(ids)], start=1):
            assert got == pytest.approx(expected[position][ids[position]].logprob, abs=1e-4)
    body = (
        server.http()
        .post(
            "/v1/completions",
            json={"model": "tiny-llama", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 1},
        )
        .json()
    )
    prompt_logprobs = body["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[2][str(ids[2])]["logprob"] == pytest.approx(expected[2][ids[2]].logprob, abs=1e-4)


def test_chat_greedy_equals_offline_chat(server, offline):
    client = server.openai()
    reply = client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, temperature=0, max_tokens=20
    )
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.prompt_tokens_details is None  # only with --enable-prompt-tokens-details
    streamed = client.chat.completions.create(
        model=reply.model,
        messages=MESSAGES,
        temperature=0,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_completions_stream_and_echo_and_logprobs(server, offline):
    client = server.openai()
    model = client.models.list().data[0].id
    full = client.completions.create(
        model=model, prompt="The robot said", max_tokens=12, temperature=0, logprobs=2
    )
    expected = offline.generate("The robot said", SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert full.choices[0].text == expected.text
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == 12 and len(lp.top_logprobs[0]) == 2 and all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == expected.text
    chunks = list(
        client.completions.create(
            model=model, prompt="The robot said", max_tokens=12, temperature=0, stream=True, logprobs=1
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset, "streamed text offsets are absolute, as in the full response"
    echo = client.completions.create(
        model=model, prompt="The robot said", max_tokens=3, temperature=0, echo=True
    )
    assert echo.choices[0].text.startswith("The robot said")


def test_n_seed_stop_and_chat_logprobs(server):
    client = server.openai()
    model = client.models.list().data[0].id
    many = client.completions.create(
        model=model, prompt="Colors:", n=3, max_tokens=8, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    again = client.completions.create(
        model=model, prompt="Colors:", n=3, max_tokens=8, temperature=1.0, seed=7
    )
    assert [c.text for c in many.choices] == [c.text for c in again.choices]
    base = (
        client.completions.create(model=model, prompt="Story:", max_tokens=30, temperature=0).choices[0].text
    )
    stop = base[len(base) // 2 : len(base) // 2 + 3]
    cut = client.completions.create(model=model, prompt="Story:", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == base[: base.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="Story:", max_tokens=30, temperature=0, stop=[stop], stream=True
        )
    )
    assert streamed == cut.choices[0].text, "a stop string must never be partly streamed"
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_32_concurrent_streams(server):
    async def main():
        client = server.openai(openai.AsyncOpenAI)
        model = (await client.models.list()).data[0].id

        async def one(i):
            stream = await client.completions.create(
                model=model,
                prompt=f"Request {i}:",
                max_tokens=16,
                temperature=0.8,
                seed=i,
                stream=True,
                extra_body={"ignore_eos": True},
                stream_options={"include_usage": True},
            )
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            return usage.completion_tokens

        return await asyncio.gather(*(one(i) for i in range(32)))

    assert asyncio.run(main()) == [16] * 32


def test_utility_routes_and_metrics(server, default_tokenizer):
    with server.http() as http:
        models = http.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["max_model_len"] == 512
        assert models["data"][0]["determinism"] == "chunk-invariant"  # cpu-native attention, default mode
        tokens = http.post("/tokenize", json={"prompt": "héllo wörld"}).json()
        assert tokens["tokens"] == default_tokenizer.encode("héllo wörld") and tokens["count"] == len(
            tokens["tokens"]
        )
        chat_tokens = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        assert default_tokenizer.decode(chat_tokens).endswith("assistant\n")
        assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "héllo wörld"
        assert http.get("/health").status_code == 200
        assert http.get("/version").json()["version"]
        spec = http.get("/openapi.json").json()
        assert {"/v1/completions", "/v1/chat/completions", "/metrics"} <= set(spec["paths"])
        assert "CompletionRequest" in spec["components"]["schemas"]
        text = http.get("/metrics").text
    for name in (
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hit_rate",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert name in text, name
    assert 'finished_reason="length"' in text


def _error(response, status: int, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


BAD_COMPLETIONS = [
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
    ({"prompt": "word " * 600, "max_tokens": 1}, 400, "prompt"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 1000}, 400, "n"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": {"not": "a prompt"}}, 400, "prompt"),
    ({"max_tokens": 3}, 400, None),
    ({"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),  # not implemented: refused, never silently ignored
]
BAD_CHATS = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ({"messages": [{"content": "no role"}]}, 400, "messages"),
    ({"messages": MESSAGES, "top_logprobs": 30, "logprobs": True}, 400, "top_logprobs"),
    ({"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": MESSAGES, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": MESSAGES, "reasoning_effort": "high", "web_search_options": {}}, 400, "reasoning_effort"),
]


def test_bad_input_gets_openai_errors_without_disturbing_others(server):
    with server.http() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        result = {}

        def long_stream():
            body = {
                "model": model,
                "prompt": "Keep going:",
                "max_tokens": 120,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with server.http() as other, other.stream("POST", "/v1/completions", json=body) as response:
                frames = [line for line in response.iter_lines() if line.startswith("data: ")]
            result["tokens"] = json.loads(frames[-2][6:])["usage"]["completion_tokens"]
            result["done"] = frames[-1] == "data: [DONE]"

        thread = threading.Thread(target=long_stream)
        thread.start()
        for body, status, param in BAD_COMPLETIONS:
            _error(http.post("/v1/completions", json={"model": model, **body}), status, param)
        for body, status, param in BAD_CHATS:
            _error(http.post("/v1/chat/completions", json={"model": model, **body}), status, param)
        _error(
            http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}),
            400,
        )
        _error(
            http.post("/v1/embeddings", json={"model": model, "input": "Hi"}), 400, "model"
        )  # generates only
        _error(http.post("/v1/completions", content=b'{"prompt": "' + b"x" * (5 * 2**20) + b'"}'), 413)
        _error(http.get("/v1/nope"), 404)
        _error(http.get("/v1/completions"), 405)
        thread.join(120)
    assert result == {"tokens": 120, "done": True}


def test_api_key_is_required_on_v1_routes(server):
    import httpx

    assert _error(httpx.get(f"{server.url}/v1/models"), 401)["code"] == "invalid_api_key"
    _error(httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200  # health stays open
    with pytest.raises(openai.AuthenticationError):
        server.openai().__class__(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_timings_when_asked_as_llama_cpp_gives_them(server):
    """``"timings": true``: llama.cpp's object, consistent with the usage; absent by default."""
    client = server.openai()
    plain = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=8, temperature=0)
    assert getattr(plain, "timings", None) is None
    reply = client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"timings": True}
    )
    timings = reply.timings
    assert timings["prompt_n"] + timings["cache_n"] == reply.usage.prompt_tokens
    assert timings["predicted_n"] == reply.usage.completion_tokens == 8
    assert 0 < timings["prompt_ms"] <= timings["ttft_ms"] and timings["queue_ms"] >= 0
    assert timings["predicted_per_second"] == pytest.approx(8 / (timings["predicted_ms"] / 1e3))
    chunks = list(
        client.completions.create(
            model="tiny-llama", prompt="Hi", max_tokens=5, n=2, stream=True, extra_body={"timings": True}
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.timings["predicted_n"] == 10
