"""Admission control: beyond ``max_queued_requests`` waiting, or ``max_queue_wait`` seconds
unscheduled, a request is refused as overloaded — in the core, and as a 503 with
``Retry-After`` from `engine serve`."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.messages.request import Request
from engine.messages.step import OVERLOADED, Overloaded
from engine.testing import reference
from tests.conftest import TINY_LLAMA
from tests.serving import serve

LONG = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def test_a_full_queue_refuses_new_requests(tiny_llama):
    engine = LLM(tiny_llama[0], dtype="float32", num_blocks=64, max_num_seqs=1, max_queued_requests=2).engine
    engine.add_request(Request("a", [5, 6], LONG))
    engine.add_request(Request("b", [5, 7], LONG))
    with pytest.raises(Overloaded, match="max_queued_requests=2") as info:
        engine.add_request(Request("c", [5, 8], LONG))
    assert info.value.code == OVERLOADED
    engine.step()  # "a" runs: one place in the queue frees up
    engine.add_request(Request("c", [5, 8], LONG))
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["rejected_queue_full"]) == (1, 2, 1)
    engine.abort(["a", "b", "c"])


def test_a_request_queued_too_long_is_refused(tiny_llama):
    engine = LLM(tiny_llama[0], dtype="float32", num_blocks=64, max_num_seqs=1, max_queue_wait=0.3).engine
    engine.add_request(Request("running", [5, 6], LONG))
    engine.step()  # admitted before its deadline: it is never refused
    engine.add_request(Request("queued", [5, 7], LONG))
    time.sleep(0.35)
    outputs = {o.request_id: o for o in engine.step()}
    refused = outputs["queued"]
    assert (refused.finish_reason, refused.error_code, refused.new_token_ids) == ("error", OVERLOADED, [])
    assert "max_queue_wait" in refused.error
    assert outputs["running"].finish_reason is None and len(outputs["running"].new_token_ids) == 1
    assert engine.stats()["rejected_queue_wait"] == 1
    assert engine.stats()["waiting"] == 0
    engine.abort(["running"])
    assert not engine.has_unfinished()


NUM_REQUESTS, MAX_NUM_SEQS, QUEUE_CAP, MAX_TOKENS = 300, 4, 64, 10


async def _burst(server) -> list[tuple[int, float, dict, httpx.Headers]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers, timeout=120, limits=limits
    ) as client:

        async def one(i):
            started = time.monotonic()
            response = await client.post(
                "/v1/completions",
                json={
                    "prompt": f"request {i}: once upon a time",
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            return response.status_code, time.monotonic() - started, response.json(), response.headers

        return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))


@pytest.mark.slow
def test_overload_gets_503_with_retry_after_and_loses_nothing(tiny_llama):
    with serve(
        tiny_llama[0],
        "--dtype",
        "float32",
        "--num-blocks",
        "256",
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-queued-requests",
        str(QUEUE_CAP),
    ) as server:
        started = time.monotonic()
        results = asyncio.run(_burst(server))
        elapsed = time.monotonic() - started

        completed = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 503]
        assert len(completed) + len(refused) == NUM_REQUESTS  # every request: a completion or a 503
        assert len(completed) >= QUEUE_CAP and refused
        for _, _, body, _ in completed:
            [choice] = body["choices"]
            assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == MAX_TOKENS
        for _, latency, body, headers in refused:
            assert int(headers["retry-after"]) >= 1
            assert (
                body["error"]["code"] == "overloaded" and body["error"]["type"] == "ServiceUnavailableError"
            )
        slowest_refusal = max(r[1] for r in refused)
        completion_median = statistics.median(r[1] for r in completed)
        print(
            f"\n{len(completed)} completed (median {completion_median:.1f} s), {len(refused)} refused "
            f"(slowest {slowest_refusal:.2f} s), all in {elapsed:.1f} s"
        )
        # refused at once: the slowest 503 took only the API's intake of the burst, not a turn in the queue
        assert slowest_refusal < completion_median

        deadline = time.monotonic() + 5  # the stats message that carries the final counts
        while _rejections(server) < len(refused) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _rejections(server) == len(refused)
        assert server.metric("vllm:num_requests_running") == 0
        assert server.metric("vllm:num_requests_waiting") == 0


def _rejections(server, reason: str = "queue_full") -> float:
    for line in httpx.get(f"{server.url}/metrics", headers=server.headers).text.splitlines():
        if line.startswith("vllm:num_requests_rejected_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(reason)


# long enough that the one running sequence still holds its slot when max_queue_wait (0.5 s) runs out:
# the tiny model decodes 400 tokens in about 0.4 s on a quiet machine
SLOT_HOLDER_TOKENS = 2000


@pytest.fixture(scope="module")
def long_context_llama(tmp_path_factory, default_tokenizer):
    """The tiny Llama with room for `SLOT_HOLDER_TOKENS`."""
    folder = str(tmp_path_factory.mktemp("long-context-llama"))
    config = {**TINY_LLAMA, "max_position_embeddings": 4096}
    reference.tiny_checkpoint(folder, "LlamaForCausalLM", config, tokenizer=default_tokenizer)
    return folder


async def _queue_wait_cases(server):
    long = {
        "prompt": "once upon a time",
        "max_tokens": SLOT_HOLDER_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as client:
        # a stream whose second sample waits behind its first: tokens, then an error frame
        async with client.stream(
            "POST", "/v1/completions", json={**long, "n": 2, "stream": True}
        ) as response:
            assert response.status_code == 200
            frames = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
        # a request behind a running one: 503 once it has waited max_queue_wait
        first_token = asyncio.Event()

        async def run_long():
            async with client.stream(
                "POST",
                "/v1/completions",
                json={**long, "stream": True, "stream_options": {"include_usage": True}},
            ) as response:
                usage = None
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage") or usage
                        first_token.set()
                return response.status_code, usage

        running = asyncio.create_task(run_long())
        await first_token.wait()  # it runs: the one sequence slot is taken
        started = time.monotonic()
        refused = await client.post("/v1/completions", json={**long, "max_tokens": 4})
        waited = time.monotonic() - started
        return frames, refused, waited, await running


@pytest.mark.slow
def test_queue_wait_refuses_with_503_and_an_error_frame_mid_stream(long_context_llama):
    with serve(
        long_context_llama,
        "--dtype",
        "float32",
        "--num-blocks",
        "256",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "1",
        "--max-queue-wait",
        "0.5",
    ) as server:
        frames, refused, waited, running = asyncio.run(_queue_wait_cases(server))
        assert frames[-1] == "[DONE]"
        assert '"text"' in frames[0]  # the first sample streamed before the second was refused
        errors = [f for f in frames if f.startswith('{"error"')]
        assert len(errors) == 1 and '"code": "overloaded"' in errors[0]
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert (
            refused.json()["error"]["code"] == "overloaded"
            and "max_queue_wait" in refused.json()["error"]["message"]
        )
        assert 0.5 <= waited < 5
        status, usage = running
        assert status == 200 and usage["completion_tokens"] == SLOT_HOLDER_TOKENS  # none lost to the refusal
        assert _rejections(server, "queue_wait") == 2
