"""Hardening round 2 (issue 32) against a real `engine serve` over sockets: a response no
larger than what it carries (prompt_logprobs once per prompt, the request budget,
--max-response-bytes, big bodies built off the event loop), safe defaults (a bounded queue,
a prefix-cache salt per API key, the Host allow-list, the body read timeout, stale IPC
folders removed) and the protocol (405 with Allow before 415, Content-Encoding refused,
/openapi.json's runtime bounds)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import pytest

from tests.serving import API_KEY, serve

pytestmark = pytest.mark.slow

OTHER_KEY = "other-key"
BUDGET = 300_000  # --max-request-budget
RESPONSE_LIMIT = 2**20  # --max-response-bytes
MAX_NUM_SEQS = 8
ARGS = (
    "--served-model-name",
    "tiny-bounds",
    "--dtype",
    "float32",
    "--num-blocks",
    "512",
    "--block-size",
    "16",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
    "--max-request-sequences",
    "64",
    "--max-request-budget",
    str(BUDGET),
    "--max-response-bytes",
    str(RESPONSE_LIMIT),
    "--request-body-timeout",
    "1",
    "--request-header-timeout",
    "1",
    "--enable-prompt-tokens-details",
    "--api-key",
    OTHER_KEY,  # serve() adds API_KEY: two tenants
)
PROMPT = list(range(1000, 1400))  # 400 token ids
C = "/v1/completions"


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.fixture(scope="module")
def stale_ipc_dir():
    """The socket folder of a front end that died without cleaning up, made before the server starts."""
    path = os.path.join(tempfile.gettempdir(), f"engine-ipc-{_dead_pid()}-bounds-test")
    os.makedirs(path)
    yield path
    with contextlib.suppress(OSError):
        os.rmdir(path)


@pytest.fixture(scope="module")
def server(tiny_llama, stale_ipc_dir):
    with serve(tiny_llama[0], *ARGS) as s:
        yield s


def _error(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


# -- 3: response amplification -------------------------------------------------------------
def test_prompt_logprobs_are_sent_once_per_prompt_off_the_event_loop(server):
    client = server.openai()
    outcome = {}

    def heavy():
        started = time.monotonic()
        outcome["raw"] = client.completions.with_raw_response.create(
            model="tiny-bounds", prompt=PROMPT, n=32, max_tokens=2, extra_body={"prompt_logprobs": 20}
        )
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=heavy)
    thread.start()
    latencies = []
    with httpx.Client(base_url=server.url, timeout=10) as http:
        while thread.is_alive():
            started = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.02)
    thread.join()
    raw = outcome["raw"]
    completion = raw.parse()
    choices = [c.model_extra for c in completion.choices]
    assert len(choices) == 32 and len(choices[0]["prompt_logprobs"]) == len(PROMPT)
    assert all(c["prompt_logprobs"] is None for c in choices[1:])  # the same numbers: sent once
    position = choices[0]["prompt_logprobs"][5]
    assert str(PROMPT[5]) in position and len(position) >= 20
    size = len(raw.http_response.content)
    assert size < RESPONSE_LIMIT, size  # repeated in each choice it was 32 times this
    assert max(latencies) < 0.5, (max(latencies), outcome["seconds"])

    chat = client.chat.completions.create(
        model="tiny-bounds",
        messages=[{"role": "user", "content": "hi"}],
        n=4,
        max_tokens=2,
        extra_body={"prompt_logprobs": 2},
    )
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens  # once, per response


def test_request_budget_is_a_400_naming_the_product_and_the_limit(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny-bounds", prompt=PROMPT, n=32, max_tokens=100, logprobs=20)
    body = error.value.body
    assert body["param"] == "logprobs" and body["code"] == "request_too_large"
    assert f"32 x (400 prompt tokens + 100) x (20 + 1) = {32 * 500 * 21}" in body["message"]
    assert str(BUDGET) in body["message"] and "--max-request-budget" in body["message"]


def test_a_response_over_max_response_bytes_is_refused(server):
    body = {"model": "tiny-bounds", "prompt": PROMPT, "n": 8, "max_tokens": 1, "echo": True, "logprobs": 20}
    with server.http() as http:
        whole = http.post(C, json=body)
        assert whole.status_code == 413, whole.text[:300]
        error = _error(whole)
        assert error["code"] == "response_too_large" and str(RESPONSE_LIMIT) in error["message"]
        with http.stream("POST", C, json={**body, "stream": True}) as stream:
            frames = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["error"]["code"] == "response_too_large"
    assert sum(len(f) for f in frames) < 2 * RESPONSE_LIMIT
    assert server.wait_for_metric("vllm:num_requests_running", lambda v: v == 0) == 0


# -- 4: defaults ---------------------------------------------------------------------------
def _raw_stream(server, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def _answer_head(sock: socket.socket, wait: float) -> bytes:
    """What the server has answered on ``sock`` so far (a queued stream: nothing yet)."""
    sock.settimeout(wait)
    try:
        return sock.recv(65536)
    except TimeoutError:
        return b""


def _rejected(server) -> float:
    for line in httpx.get(f"{server.url}/metrics", headers=server.headers).text.splitlines():
        if line.startswith("vllm:num_requests_rejected_total{") and 'reason="queue_full"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_queue_is_bounded_by_default(server):
    """A burst far past what runs and may wait: the excess is refused at once (503 with
    Retry-After), and no more than the automatic bound ever waits."""
    bound = 64  # auto: 2 x min(--max-num-seqs 8, 8192 KV tokens / 512 context), at least 64
    body = {"model": "tiny-bounds", "prompt": "Go on:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    rejected = _rejected(server)
    socks = [_raw_stream(server, body) for _ in range(MAX_NUM_SEQS + bound + 48)]
    try:
        waiting = server.wait_for_metric("vllm:num_requests_waiting", lambda v: v >= bound - 16)
        heads = [_answer_head(sock, 0.05) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    refused = [head for head in heads if head.startswith(b"HTTP/1.1 503")]
    assert refused and _rejected(server) > rejected and waiting <= bound
    for head in refused:
        assert b"retry-after: 1" in head.lower() and f"max_queued_requests={bound}".encode() in head, head
    server.wait_for_metric("vllm:num_requests_waiting", lambda v: v == 0)
    server.wait_for_metric("vllm:num_requests_running", lambda v: v == 0)


def test_each_api_key_gets_its_own_prefix_cache(server):
    prompt = list(range(3000, 3064))  # four blocks

    def cached(key: str) -> int:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
        completion = client.completions.create(model="tiny-bounds", prompt=prompt, max_tokens=1)
        return completion.usage.prompt_tokens_details.cached_tokens

    assert cached(API_KEY) == 0
    assert cached(API_KEY) >= 48  # the same tenant: its prefix is cached
    assert cached(OTHER_KEY) == 0  # another tenant never hits it
    assert cached(OTHER_KEY) >= 48


def test_host_header_must_be_a_loopback_name(server):
    with server.http() as http:
        for host in ("evil.example", f"evil.example:{server.port}", "192.168.1.5"):
            refused = http.get("/v1/models", headers={"Host": host})
            assert refused.status_code == 421 and _error(refused)["code"] == "invalid_host", host
        for host in (f"localhost:{server.port}", "127.0.0.1", f"[::1]:{server.port}"):
            assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host


def test_a_stalled_body_gets_a_408_and_loses_its_connection(server):
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(10)
    started = time.monotonic()
    sock.sendall(
        f"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt": '.encode()
    )
    received = b""
    with contextlib.closing(sock):
        while chunk := sock.recv(65536):  # until the server closes the connection
            received += chunk
    seconds = time.monotonic() - started
    assert received.startswith(b"HTTP/1.1 408") and b"body_timeout" in received, received[:300]
    assert 0.9 < seconds < 5, seconds


def test_stalled_headers_get_a_408_and_lose_their_connection(server):
    """Headers trickling in are cut off (--request-header-timeout 1) on a fresh connection and on
    one that already served a request; a request whose headers came in time is not."""
    fresh = socket.create_connection(("127.0.0.1", server.port))
    fresh.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    used = socket.create_connection(("127.0.0.1", server.port))
    used.sendall(
        f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n\r\n".encode()
    )
    assert used.recv(65536).startswith(b"HTTP/1.1 200")
    used.sendall(b"GET /health HTTP/1.1\r\n")
    started = time.monotonic()
    for sock in (fresh, used):
        sock.settimeout(10)
        received = b""
        with contextlib.closing(sock):
            while chunk := sock.recv(65536):  # until the server closes the connection
                received += chunk
        assert received.startswith(b"HTTP/1.1 408") and b"header_timeout" in received, received[:300]
    assert time.monotonic() - started < 5
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_stale_ipc_folders_are_removed_at_start_up(server, stale_ipc_dir):
    assert not os.path.exists(stale_ipc_dir)


# -- 5: protocol ---------------------------------------------------------------------------
def test_405_carries_allow_and_comes_before_415(server):
    with server.http() as http:
        get = http.get(C)
        assert get.status_code == 405 and get.headers["allow"] == "POST"
        assert _error(get)["code"] == "405"
        plain = http.post("/health", content=b"x", headers={"Content-Type": "text/plain"})
        assert plain.status_code == 405 and set(plain.headers["allow"].split(", ")) == {"GET", "HEAD"}
        assert http.post("/nowhere", content=b"x").status_code == 404


def test_content_encoding_is_refused(server):
    with server.http() as http:
        for encoding in ("gzip", "br", "deflate"):
            response = http.post(
                "/tokenize",
                content=json.dumps({"prompt": "hi"}).encode(),  # labelled compressed, sent plain
                headers={"Content-Type": "application/json", "Content-Encoding": encoding},
            )
            assert response.status_code == 415 and encoding in _error(response)["message"], encoding
        plain = http.post("/tokenize", json={"prompt": "hi"}, headers={"Content-Encoding": "identity"})
        assert plain.status_code == 200


def test_openapi_declares_runtime_bounds_and_responses(server):
    with server.http() as http:
        spec = http.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    vocab = 49152
    assert completion["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == vocab - 1
    assert completion["n"]["maximum"] == 64 and completion["max_tokens"]["anyOf"][0]["maximum"] == 511
    assert {"type": "string", "minLength": 1} in completion["prompt"]["anyOf"]
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == vocab - 1
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    truncation = [{"const": -1}, {"type": "integer", "minimum": 1, "maximum": 512}]  # 0 is a 400
    for name in (
        "CompletionRequest",
        "EmbeddingRequest",
        "ScoreRequest",
        "RerankRequest",
        "ClassificationRequest",
    ):
        assert schemas[name]["properties"]["truncate_prompt_tokens"]["anyOf"][:2] == truncation, name
    prompts = completion["prompt"]["anyOf"][1]["maxItems"]  # --max-request-sequences
    rerank = schemas["RerankRequest"]["properties"]
    assert rerank["documents"]["maxItems"] == prompts and rerank["query"] == {
        "type": "string",
        "minLength": 1,
    }
    assert {"type": "string", "minLength": 1} in schemas["ScoreRequest"]["properties"]["text_1"]["anyOf"]
    ok = spec["paths"][C]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/CompletionResponse")
    assert "text/event-stream" in ok
    assert "prompt_logprobs" in schemas["CompletionChoice"]["properties"]
