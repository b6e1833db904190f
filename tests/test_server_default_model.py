"""The server on the embedded default model: greedy chat equals the offline API, and a
client that disconnects mid-stream has its request aborted and its KV blocks freed."""

from __future__ import annotations

import time

import pytest

from engine import LLM, SamplingParams
from tests.serving import serve

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three colors of the rainbow."]


@pytest.fixture(scope="module")
def server():
    with serve(
        None, "--dtype", "float32", "--max-model-len", "4096", "--num-blocks", "512", api_key=None
    ) as s:
        yield s


def test_greedy_chat_equals_llm_chat(server):
    client = server.openai()
    model = client.models.list().data[0].id
    llm = LLM(dtype="float32", max_model_len=4096, num_blocks=512)
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=40)
        expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
        assert reply.choices[0].message.content == expected.text
        assert reply.choices[0].finish_reason == expected.finish_reason


def test_disconnect_mid_stream_frees_kv_blocks(server):
    ran_to_length = _finished(server, "length")  # the module's earlier requests
    with server.http() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": "Count upwards:",
            "max_tokens": 3000,
            "stream": True,
            "ignore_eos": True,
        }
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            deadline = time.monotonic() + 10
            while server.metric("vllm:kv_cache_usage_perc") == 0 and time.monotonic() < deadline:
                next(lines)
            assert server.metric("vllm:kv_cache_usage_perc") > 0
            assert server.metric("vllm:num_requests_running") == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.metric("vllm:kv_cache_usage_perc") > 0:
        time.sleep(0.2)
    assert server.metric("vllm:kv_cache_usage_perc") == 0.0
    assert server.metric("vllm:num_requests_running") == 0.0
    assert _finished(server, "length") == ran_to_length  # it never ran to completion


def _finished(server, reason: str) -> float:
    """Requests finished for ``reason`` so far (0 before the first)."""
    import httpx

    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{") and f'finished_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
