"""Prefill/decode disaggregation through real processes, once per P/D connector installed (``p2p``
over ZMQ; ``NixlConnector``, vLLM's name of the nixl connector, reading with NIXL): a prefill
`engine serve` (kv_producer), two decode `engine serve` instances (kv_consumer) and `engine proxy`
in front, driven by the official `openai` client.

- 16 concurrent requests of mixed lengths (some streamed, one chat) through the proxy give the
  greedy float32 output of a single instance, and the decode instance computed none of the prompt
  blocks it pulled (``cached_tokens``); both instances' KV usage returns to 0.
- Killing the decode instance while requests stream and transfer fails those requests alone, with
  OpenAI-shaped errors; the prefill instance keeps serving (a request it was generating finishes)
  and frees the blocks nobody will read (``abort_request_timeout``): its KV usage returns to 0.
- Killing the prefill instance: requests that still needed it fail with an OpenAI-shaped 502; a
  decode instance whose pull fails computes the prompt itself (same output), keeps serving (a
  request it was generating finishes), and its KV usage returns to 0.

The instances and both proxies (prefill + first decode, prefill + second decode) start once per
connector and serve the three tests in order: each kill leaves the next test what it needs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import time

import attrs
import httpx
import openai
import pytest

from engine.messages.sampling_params import SamplingParams
from engine.plugins import load_plugins
from engine.testing import reference
from tests.serving import API_KEY, ENGINE, Server, free_port, serve

pytestmark = pytest.mark.slow

BLOCK = 16
HOLD_SECONDS = 3  # the prefill instance's abort_request_timeout here
COMMON = (
    "--served-model-name",
    "tiny",
    "--dtype",
    "float32",
    "--block-size",
    str(BLOCK),
    "--num-blocks",
    "160",
    "--max-model-len",
    "512",
    "--enable-prompt-tokens-details",
)
LENGTHS = [5, 12, 17, 31, 33, 48, 64, 70, 90, 100, 111, 128, 140, 150, 160, 180]
MAX_TOKENS = [4, 9, 6, 12, 5, 8, 10, 7, 11, 4, 6, 9, 12, 5, 8, 7]


def missing(connector: str) -> str | None:
    """Why ``connector`` cannot run here, or None."""
    if connector not in load_plugins().names("kv_connectors"):
        return f"no KV connector {connector!r} is installed"
    if connector == "NixlConnector":
        from engine_kvconnectors_nixl import nixl_api

        return nixl_api.missing_reason()
    return None


def runs_here(connector: str):
    reason = missing(connector)
    return pytest.mark.skipif(reason is not None, reason=str(reason))


CONNECTORS = [
    pytest.param(name, id=label, marks=runs_here(name))
    for name, label in (("p2p", "p2p"), ("NixlConnector", "nixl"))
]


def transfer(connector: str, role: str, port: int = 0) -> str:
    config = {
        "kv_connector": connector,
        "kv_role": role,
        "kv_ip": "127.0.0.1",
        "kv_connector_extra_config": {"abort_request_timeout": HOLD_SECONDS, "transfer_timeout": 10},
    }
    if port:
        config["kv_port"] = port
    return json.dumps(config)


@contextlib.contextmanager
def proxy(prefill_url: str, decode_url: str):
    """`engine proxy` in front of the two instances (it starts before they answer); an `openai`
    client of it."""
    port = free_port()
    process = subprocess.Popen(
        [ENGINE, "proxy", "--port", str(port), "--prefill", prefill_url, "--decode", decode_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read()
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{url}/health", timeout=2)
                break
            assert time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.2)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    finally:
        process.terminate()
        process.wait(10)


@contextlib.contextmanager
def together(managers: list):
    """Enters the context managers side by side (each waits on its own process) and exits them
    side by side."""
    with concurrent.futures.ThreadPoolExecutor(len(managers)) as pool:
        entering = [pool.submit(manager.__enter__) for manager in managers]
        concurrent.futures.wait(entering)
        try:
            yield [future.result() for future in entering]
        finally:
            entered = [m for m, future in zip(managers, entering) if future.exception() is None]
            for exiting in [pool.submit(manager.__exit__, None, None, None) for manager in entered]:
                exiting.result()


@attrs.frozen
class Deployment:
    prefill: Server
    decode: Server
    spare_decode: Server  # for the last test: the first decode instance is killed by then
    client: openai.OpenAI  # the proxy of prefill + decode
    spare_client: openai.OpenAI  # the proxy of prefill + spare_decode


@pytest.fixture(scope="module", params=CONNECTORS)
def deployment(request, tiny_llama):
    """One connector's instances and proxies, all started at once, for this module's tests in order."""
    connector = request.param
    specs = [
        transfer(connector, "kv_producer", free_port()),
        transfer(connector, "kv_consumer"),
        transfer(connector, "kv_consumer"),
    ]
    ports = [free_port() for _ in specs]
    prefill_url, decode_url, spare_url = (f"http://127.0.0.1:{port}" for port in ports)
    servers = [
        serve(tiny_llama[0], *COMMON, "--kv-transfer-config", spec, port=port)
        for spec, port in zip(specs, ports)
    ]
    with together([*servers, proxy(prefill_url, decode_url), proxy(prefill_url, spare_url)]) as started:
        yield Deployment(*started)


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    return reference.random_prompts(tiny_llama[1].config.vocab_size, LENGTHS + [200] * 8 + [60] * 4, seed=21)


def kill(server) -> None:
    """The whole instance at once: its engine core and its API process."""
    core = server.core_pid()
    os.kill(core, signal.SIGKILL)
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(10)


def complete(client, prompt, max_tokens, **extra):
    return client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )


def streamed_text(client, prompt, max_tokens) -> str:
    return finished_text(started_stream(client, prompt, max_tokens))


def expected(tiny_llm, prompts, max_tokens) -> list[str]:
    outs = tiny_llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens],
    )
    return [o.outputs[0].text for o in outs]


def openai_error(exc: BaseException) -> dict:
    """The OpenAI-shaped error body the client raised with."""
    assert isinstance(exc, openai.APIError), repr(exc)
    assert isinstance(exc.body, dict) and "message" in exc.body, exc.body
    return exc.body


def started_stream(client, prompt, max_tokens):
    """A streamed completion that has its first chunk: generating now. (the stream, its chunks so far)"""
    stream = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    return chunks, [next(chunks)]


def finished_text(started) -> str:
    chunks, first = started
    return "".join(chunk.choices[0].text for chunk in [*first, *chunks] if chunk.choices)


def test_pd_through_the_proxy_gives_the_single_instance_output(deployment, prompts, tiny_llm):
    prefill, decode, client = deployment.prefill, deployment.decode, deployment.client
    prompts = prompts[: len(LENGTHS)]
    want = expected(tiny_llm, prompts, MAX_TOKENS)
    chat = [{"role": "user", "content": "Name three prime numbers and one colour."}]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [
            pool.submit(streamed_text if i % 4 == 3 else complete, client, p, m)
            for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))
        ]
        via_pd_chat = client.chat.completions.create(model="tiny", messages=chat, max_tokens=8, temperature=0)
        got = [f.result(timeout=120) for f in futures]
    texts = [g if isinstance(g, str) else g.choices[0].text for g in got]
    assert texts == want
    for g, p in zip(
        got, prompts
    ):  # the decode instance computed only what the prefill instance did not hand on
        if not isinstance(g, str):
            assert g.usage.prompt_tokens_details.cached_tokens == (len(p) - 1) // BLOCK * BLOCK, len(p)
    alone = prefill.openai().chat.completions.create(model="tiny", messages=chat, max_tokens=8, temperature=0)
    assert via_pd_chat.choices[0].message.content == alone.choices[0].message.content
    pulled = sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
    assert decode.wait_for_metric("vllm:external_prefix_cache_hits_total", lambda v: v >= pulled) >= pulled
    assert decode.metric("vllm:kv_connector_load_failures_total") == 0
    for server in (prefill, decode):
        server.wait_for_metric("vllm:kv_cache_usage_perc", lambda v: v == 0)
    direct = decode.openai()
    for bad in ({"do_remote_prefill": True, "remote_engine_id": "p"}, {"do_remote_decode": "yes"}, [1]):
        with pytest.raises(openai.BadRequestError) as caught:
            complete(direct, prompts[0], 2, kv_transfer_params=bad)
        assert "kv_transfer_params" in caught.value.body["message"], caught.value.body
    with pytest.raises(openai.BadRequestError, match="n=1"):
        complete(direct, prompts[0], 2, n=2, kv_transfer_params={"do_remote_decode": True})


def test_killing_the_decode_instance_fails_only_its_requests(deployment, prompts, tiny_llm):
    prefill, client = deployment.prefill, deployment.client
    long_prompts = prompts[len(LENGTHS) : len(LENGTHS) + 8]
    own = started_stream(prefill.openai(), prompts[1], 40)  # the prefill instance's own request, generating
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [
            started_stream(client, p, 300)[0] for p in long_prompts[:4]
        ]  # decoding on the decode instance
        in_flight = [pool.submit(complete, client, p, 50) for p in long_prompts[4:]]  # in prefill or transfer
        kill(deployment.decode)
        failures = []
        for stream in streams:
            with pytest.raises(openai.APIError) as caught:
                for _ in stream:
                    pass
            failures.append(caught.value)
        for future in in_flight:
            with pytest.raises(openai.APIError) as caught:
                future.result(timeout=60)
            failures.append(caught.value)
    with pytest.raises(openai.APIStatusError) as after:  # prefilled (blocks held), the decode leg fails
        complete(client, prompts[0], 4)
    assert after.value.status_code == 502 and openai_error(after.value)["code"] == "decode_unavailable"
    assert all(openai_error(f) for f in failures)
    # the prefill instance is untouched: its own request finished, it keeps serving, and the blocks
    # held for the dead decode instance are freed (abort_request_timeout): KV usage back to 0
    assert finished_text(own) == expected(tiny_llm, [prompts[1]], [40])[0]
    assert (
        complete(prefill.openai(), prompts[2], MAX_TOKENS[2]).choices[0].text
        == expected(tiny_llm, [prompts[2]], [MAX_TOKENS[2]])[0]
    )
    prefill.wait_for_metric("vllm:kv_cache_usage_perc", lambda v: v == 0, timeout=HOLD_SECONDS + 30)


def test_killing_the_prefill_instance_fails_only_its_requests(deployment, prompts, tiny_llm):
    prefill, decode, client = deployment.prefill, deployment.spare_decode, deployment.spare_client
    short = prompts[len(LENGTHS) + 8 :]
    want = expected(tiny_llm, short, [6] * len(short))
    params = complete(prefill.openai(), short[0], 1, kv_transfer_params={"do_remote_decode": True})
    handed_on = params.model_extra["kv_transfer_params"]
    assert handed_on["do_remote_prefill"] and handed_on["remote_block_ids"]
    own = started_stream(decode.openai(), prompts[3], 40)  # the decode instance's own request, generating
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        racing = [pool.submit(complete, client, p, 6) for p in short[1:]]
        kill(prefill)
        # the pull from a dead instance fails: the decode instance computes the prompt, same output
        orphan = complete(decode.openai(), short[0], 6, kv_transfer_params=handed_on)
        assert orphan.choices[0].text == want[0]
        assert orphan.usage.prompt_tokens_details.cached_tokens == 0
        assert decode.wait_for_metric("vllm:kv_connector_load_failures_total", lambda v: v >= 1) >= 1
        for future, text in zip(racing, want[1:]):  # each finished before the kill, or failed with a 502
            try:
                assert future.result(timeout=60).choices[0].text == text
            except openai.APIStatusError as exc:
                assert exc.status_code == 502, exc
                assert openai_error(exc)["code"] == "prefill_unavailable"
    with pytest.raises(openai.APIStatusError) as after:
        complete(client, short[1], 6)
    assert after.value.status_code == 502 and openai_error(after.value)["code"] == "prefill_unavailable"
    # the decode instance is untouched: its own request finished, it keeps serving, KV usage back to 0
    assert finished_text(own) == expected(tiny_llm, [prompts[3]], [40])[0]
    assert complete(decode.openai(), short[2], 6).choices[0].text == want[2]
    decode.wait_for_metric("vllm:kv_cache_usage_perc", lambda v: v == 0)
