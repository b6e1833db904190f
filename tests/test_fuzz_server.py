"""Bad input against a real `engine serve`: every class of the hardening sweep (issue 17), with
the bodies it quoted, then `schemathesis` examples generated from /openapi.json (and those of
the pooling routes against a cross-encoder server, where they score for real). Throughout:
no response >= 500, none slower than 10 s, the engine core never dies, a greedy canary
request run between the cases keeps its text, and after every error the running/waiting
gauges return to where they were (no orphaned engine request). Also: requests whose client
leaves while queued or decoding are aborted, heavy bodies are tokenized off the event loop,
and the edge checks what needs the key, the content type and the body size."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import socket
import struct
import threading
import time
import zlib
from typing import ClassVar

import httpx
import pytest

from engine.testing import reference
from tests.conftest import TINY_LLAMA
from tests.serving import API_KEY, serve

pytestmark = pytest.mark.slow

MAX_SEQUENCES = 4  # --max-request-sequences
COMMON_ARGS = (
    "--served-model-name",
    "tiny-fuzz",
    "--dtype",
    "float32",
    "--num-blocks",
    "256",
    "--block-size",
    "16",
    "--max-request-sequences",
    str(MAX_SEQUENCES),
)
# a short context bounds what any generated request can ask for (the 10 s limit holds on a busy machine)
FUZZ_ARGS = (*COMMON_ARGS, "--max-model-len", "64", "--max-num-seqs", "4")
# long requests and two rows: requests that stay running or waiting while a test looks at them
BUSY_ARGS = (*COMMON_ARGS, "--max-model-len", "8192", "--max-num-seqs", "2", "--num-blocks", "1024")
BUSY_TOKENS = 6000  # a request's length there: 400 tokens took 0.46 s on an AMX Xeon
C, CHAT, RESP = "/v1/completions", "/v1/chat/completions", "/v1/responses"
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
DEEP = 10_000
HI = '{"messages": [{"role": "user", "content": "hi"}]'  # the start of a chat body
SLOW = 10.0  # seconds: no answer may take longer
OPENAI_ERROR = {"message", "type", "param", "code"}  # the keys of an error's "error" object
ANTHROPIC_ERROR = {"message", "type"}


def deep_list(depth: int = DEEP) -> str:
    return "[" * depth + "]" * depth


def deep_object(depth: int = DEEP) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


# (route, raw JSON body, expected status, expected param); raw text so 10k-deep nesting is expressible
def _cases() -> list[tuple[str, str, int, str | None]]:
    j = json.dumps
    cases = []
    for ids in ([1000000], [-49153], [2**63 - 1], [2**70]):
        cases += [
            (C, j({"prompt": "hi", "min_tokens": 2, "stop_token_ids": ids}), 400, "stop_token_ids"),
            (CHAT, j({"messages": MSG, "min_tokens": 2, "stop_token_ids": ids}), 400, "stop_token_ids"),
            (C, j({"prompt": "hi", "stop_token_ids": ids}), 400, "stop_token_ids"),
        ]
    for field in ("top_k", "seed", "priority", "n", "max_tokens", "min_tokens", "logprobs"):
        cases += [
            (C, j({"prompt": "hi", field: 2**70}), 400, field),
            (C, j({"prompt": "hi", field: -(2**70)}), 400, field),
        ]
    cases += [
        (C, j({"prompt": "hi", "seed": 2**64 - 1, "n": 2}), 400, "seed"),
        (C, j({"prompt": "hi", "seed": 2**63 - 1, "n": 2}), 400, "seed"),
        (CHAT, j({"messages": MSG, "seed": 2**63 - 1, "n": 2}), 400, "seed"),
        (C, j({"prompt": "hi", "top_k": -2}), 400, "top_k"),
        (
            CHAT,
            j({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": "x"}}),
            400,
            "response_format",
        ),
        (
            CHAT,
            j({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": ["x"]}}),
            400,
            "response_format",
        ),
        (
            CHAT,
            j({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}}),
            400,
            "response_format",
        ),
        (
            CHAT,
            j(
                {
                    "messages": MSG,
                    "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
                }
            ),
            400,
            "response_format",
        ),
        (CHAT, j({"messages": MSG, "response_format": "json"}), 400, "response_format"),
        (
            CHAT,
            j({"messages": MSG, "tools": [TOOL], "tool_choice": {"type": "function", "function": "f"}}),
            400,
            "tool_choice",
        ),
        (
            CHAT,
            j({"messages": MSG, "tools": [TOOL], "tool_choice": {"type": "function", "function": ["f"]}}),
            400,
            "tool_choice",
        ),
        (
            CHAT,
            j(
                {
                    "messages": MSG,
                    "tools": [TOOL],
                    "tool_choice": {"type": "function", "function": {"name": 5}},
                }
            ),
            400,
            "tool_choice",
        ),
        (
            CHAT,
            j(
                {
                    "messages": MSG,
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
                }
            ),
            400,
            "tools",
        ),
        (
            CHAT,
            j(
                {
                    "messages": MSG,
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
                }
            ),
            400,
            "tools",
        ),
        (C, j({"prompt": "hi", "structured_outputs": {"choice": "abc"}}), 400, "structured_outputs"),
        (C, j({"prompt": "hi", "structured_outputs": {"choice": []}}), 400, "structured_outputs"),
        (C, j({"prompt": "hi", "structured_outputs": {"regex": ["a"]}}), 400, "structured_outputs"),
        (C, j({"prompt": "hi", "guided_choice": "abc"}), 400, "guided_choice"),
        (C, j({"prompt": "hi", "guided_json": "not json"}), 400, "guided_json"),
        (C, j({"prompt": "hi", "guided_json": '{"type": "nope"}'}), 400, "guided_json"),
        (C, j({"prompt": "hi", "guided_json": {"type": "object", "$schema": 5}}), 400, "guided_json"),
        # 10k-deep nesting in schemas, tool parameters, messages and prompt lists
        (
            CHAT,
            (
                f'{HI}, "response_format": {{"type": "json_schema", '
                f'"json_schema": {{"schema": {deep_object()}}}}}}}'
            ),
            400,
            None,
        ),
        (
            CHAT,
            (
                f'{HI}, "tools": [{{"type": "function", '
                f'"function": {{"name": "f", "parameters": {deep_object()}}}}}]}}'
            ),
            400,
            None,
        ),
        (
            CHAT,
            f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": {deep_list()}}}]}}]}}',
            400,
            None,
        ),
        (CHAT, f'{{"messages": {deep_list()}}}', 400, None),
        (C, f'{{"prompt": {deep_list()}}}', 400, None),
        (C, f'{{"prompt": "hi", "guided_json": {deep_object()}}}', 400, None),
        # within the recursion limit but past the depth limit: named
        (C, f'{{"prompt": "hi", "guided_json": {deep_object(100)}}}', 400, "guided_json"),
        (C, f'{{"prompt": {deep_list(100)}}}', 400, "prompt"),
        (
            CHAT,
            (
                f'{HI}, "tools": [{{"type": "function", '
                f'"function": {{"name": "f", "parameters": {deep_object(100)}}}}}]}}'
            ),
            400,
            "tools",
        ),
        (
            "/tokenize",
            f'{{"messages": [{{"role": "user", "content": "hi", "tool_calls": [{deep_object(100)}]}}]}}',
            400,
            "messages",
        ),
        # the fan-out cap, stop lists and stop strings
        (C, j({"prompt": ["a"] * (MAX_SEQUENCES + 1)}), 400, "prompt"),
        (C, j({"prompt": ["a", "b"], "n": MAX_SEQUENCES}), 400, "n"),
        (CHAT, j({"messages": MSG, "n": MAX_SEQUENCES + 1}), 400, "n"),
        (C, j({"prompt": ["x"] * 1000}), 400, "prompt"),
        (C, j({"prompt": "hi", "stop": ["s"] * 100_000}), 400, "stop"),
        (C, j({"prompt": "hi", "stop": "s" * 5000}), 400, "stop"),
        ("/detokenize", j({"tokens": [2**70]}), 400, "tokens"),
        ("/detokenize", j({"tokens": [10**9]}), 400, "tokens"),
        (C, j({"prompt": [1, 2, 2**70]}), 400, "prompt"),
        # vLLM's token masks, truncation and chat template fields (the vocabulary and context are known)
        (C, j({"prompt": "hi", "logit_bias": {"1000000": 5}}), 400, "logit_bias"),
        (C, j({"prompt": "hi", "logit_bias": {"x": 5}}), 400, "logit_bias"),
        (CHAT, j({"messages": MSG, "logit_bias": {"5": -101}}), 400, "logit_bias"),
        (C, j({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(2000)}}), 400, "logit_bias"),
        (C, j({"prompt": "hi", "allowed_token_ids": [2**63 - 1]}), 400, "allowed_token_ids"),
        (CHAT, j({"messages": MSG, "allowed_token_ids": []}), 400, "allowed_token_ids"),
        (C, j({"prompt": "hi", "bad_words": ["w"] * 1000}), 400, "bad_words"),
        (C, j({"prompt": "hi", "bad_words": [" "]}), 400, "bad_words"),
        (C, j({"prompt": "hi", "truncate_prompt_tokens": 65}), 400, "truncate_prompt_tokens"),
        (C, j({"prompt": "hi", "truncate_prompt_tokens": -(2**70)}), 400, "truncate_prompt_tokens"),
        (
            CHAT,
            j({"messages": MSG, "chat_template_kwargs": {"tokenize": False}}),
            400,
            "chat_template_kwargs",
        ),
        (CHAT, j({"messages": MSG, "chat_template_kwargs": {"messages": []}}), 400, "chat_template_kwargs"),
        (CHAT, j({"messages": MSG, "continue_final_message": True}), 400, "continue_final_message"),
        # refused by the engine's grammar compiler after submitting: the engine request must not linger
        (C, j({"prompt": "hi", "guided_regex": "([a-z"}), 400, None),
        (C, j({"prompt": "hi", "guided_regex": "([a-z", "stream": True}), 400, None),
        (CHAT, j({"messages": MSG, "guided_grammar": "root ::= ???", "n": 2}), 400, None),
        # masks and a grammar that leave no token: the step's fault isolation fails this request alone
        (C, j({"prompt": "hi", "guided_choice": ["apple"], "allowed_token_ids": [5]}), 400, None),
    ]
    cases += [  # images for a text-only model, and a content part no route takes
        (CHAT, j({"messages": image_messages(png_url(2, 2))}), 400, "messages"),
        (CHAT, j({"messages": [user([{"type": "input_audio", "input_audio": {}}])]}), 400, "messages"),
    ]
    fc = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    cases += [  # /v1/responses: its own fields, and those it hands to the chat route's checks
        (RESP, f'{{"input": {deep_list()}}}', 400, None),
        (RESP, f'{{"input": [{{"role": "user", "content": {deep_list(100)}}}]}}', 400, "input"),
        (RESP, j({"input": [5]}), 400, "input"),
        (RESP, j({"input": [{"role": "user", "content": [5]}]}), 400, "input"),
        (RESP, j({"input": [{"type": "function_call_output", "call_id": 1, "output": "x"}]}), 400, "input"),
        (RESP, j({"input": "hi", "tools": [{**fc, "parameters": deep_object(100)}]}), 400, "tools"),
        (
            RESP,
            j({"input": "hi", "text": {"format": {"type": "json_schema", "name": "s", "schema": []}}}),
            400,
            "text",
        ),
        (RESP, j({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}), 400, "metadata"),
        (RESP, j({"input": "hi", "seed": 2**70}), 400, "seed"),
        (RESP, j({"input": "hi", "previous_response_id": "x" * 10_000}), 404, "previous_response_id"),
        (
            RESP,
            j(
                {
                    "input": "hi",
                    "tools": [fc],
                    "tool_choice": "required",
                    "text": {"format": {"type": "json_object"}},
                }
            ),
            400,
            "tool_choice",
        ),
    ]
    # the pooling routes on a server that generates: a 400 naming the model, nothing queued
    cases += [
        ("/score", j({"text_1": "a", "text_2": ["b", "c"]}), 400, "model"),
        ("/v1/rerank", j({"query": "a", "documents": ["b"]}), 400, "model"),
        ("/classify", j({"input": "a"}), 400, "model"),
    ]
    return cases


def user(content: list) -> dict:
    return {"role": "user", "content": content}


def image_part(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def image_messages(*urls, text: str = "look ") -> list[dict]:
    return [user([{"type": "text", "text": text}, *(image_part(url) for url in urls)])]


def png_url(width: int, height: int, cut: int | None = None) -> str:
    """A data URL of a ``width`` x ``height`` PNG (its first ``cut`` bytes only: a broken one)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (9, 9, 9)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()[:cut]).decode()


def png_header_url(width: int, height: int) -> str:
    """A PNG whose header claims ``width`` x ``height`` pixels over a few bytes of data: a
    decompression bomb as the decoder first sees one."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png = b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"\0" * 10)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _image_cases(model: str) -> list[tuple[str, str, int, str | None, str]]:
    """Bad images for the tiny LLaVA server (tests/conftest.py: at most 2 images a prompt,
    --max-model-len 72, 16 tokens an image, file: and http(s) URLs as its flags allow), each
    with what its error message must say."""
    j = json.dumps
    good = png_url(8, 8)
    bad_urls = [
        ("data:image/png;base64,***", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"no image here").decode(), "not an image"),
        (png_header_url(10_000, 10_000), "(100000000 pixels) exceeds the limit"),  # before decoding
        (png_header_url(100_000, 100_000), "decompression bomb"),  # PIL's own check, past twice that
        (png_url(64, 64, cut=60), "broken"),  # a truncated PNG
        (png_header_url(60_000, 1), "more than 200 times as long as it is wide"),  # resized: 3.4M x 56
        ("ftp://127.0.0.1/cat.png", "a 'ftp' URL is not accepted"),
        ("http://example.com/cat.png", "fetching from 'example.com' is not allowed"),
        ("file:///etc/passwd", "the file: URL leads outside allowed_local_media_path"),
        (5, "image_url: give {'url'"),
    ]
    cases = [(CHAT, j({"messages": image_messages(url)}), 400, "messages", said) for url, said in bad_urls]
    return [
        *cases,
        (
            CHAT,
            j({"messages": image_messages(good, good, good)}),
            400,
            "messages",
            "3 image(s) exceed the limit of 2",
        ),
        (
            CHAT,
            j({"messages": image_messages(good, good, text="x" * 30)}),
            400,
            "messages",
            "(32 of its tokens are image placeholders)",
        ),
        (
            CHAT,
            j({"messages": [user([{"type": "video_url", "video_url": {"url": good}}])]}),
            400,
            "messages",
            "unsupported content part 'video_url'",
        ),
        (
            CHAT,
            j({"messages": image_messages(good, text="<image> twice ")}),
            400,
            "messages",
            "1 image(s) but the prompt has 2 image placeholder(s)",
        ),
        (
            CHAT,
            j({"messages": [user([{"type": "image_pil", "image_pil": "x"}])]}),
            400,
            "messages",
            "image_pil: give a PIL image",
        ),
        (C, j({"prompt": "hi", "multi_modal_data": {"image": good}}), 400, None, "multi_modal_data"),
        *_other_route_image_cases(model, good),
    ]


def _other_route_image_cases(model: str, good: str) -> list[tuple[str, str, int, str | None, str]]:
    """The same limits through /v1/responses' ``input_image`` parts and /v1/messages' image
    blocks (Anthropic-shaped errors, which name no param), which read images as the chat route."""
    j = json.dumps

    def response_input(*urls: str) -> str:
        parts = [
            {"type": "input_text", "text": "look"},
            *({"type": "input_image", "image_url": u} for u in urls),
        ]
        return j({"input": [user(parts)], "max_output_tokens": 2})

    def message(*urls: str) -> str:
        sources = [{"type": "base64", "media_type": "image/png", "data": u.split(",", 1)[1]} for u in urls]
        blocks = [{"type": "image", "source": source} for source in sources]
        return j(
            {"model": model, "messages": [user([{"type": "text", "text": "look"}, *blocks])], "max_tokens": 2}
        )

    bomb, limit = png_header_url(100_000, 100_000), "3 image(s) exceed the limit of 2"
    return [
        (RESP, response_input(bomb), 400, "input", "decompression bomb"),
        (RESP, response_input(good, good, good), 400, "input", limit),
        (RESP, response_input(png_url(64, 64, cut=60)), 400, "input", "broken"),
        ("/v1/messages", message(png_header_url(10_000, 10_000)), 400, None, "exceeds the limit"),
        ("/v1/messages", message(good, good, good), 400, None, limit),
    ]


def within_slow(server) -> httpx.Client:
    """A client that fails any answer slower than :data:`SLOW`."""
    return httpx.Client(base_url=server.url, headers=server.headers, timeout=SLOW)


def gauges(server) -> tuple[float, float]:
    """(running, waiting) from one scrape of /metrics."""
    values = {}
    for line in httpx.get(f"{server.url}/metrics", headers=server.headers).text.splitlines():
        name = line.split("{", 1)[0]
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            values[name] = float(line.rsplit(" ", 1)[1])
    return values["vllm:num_requests_running"], values["vllm:num_requests_waiting"]


def settled(
    server, expected: tuple[float, float], timeout: float = 5.0, calm: float = 0.0
) -> tuple[float, float]:
    """Gauges once they equal ``expected`` (and still do ``calm`` seconds later), or the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        now = gauges(server)
        if now == expected:
            if not calm:
                return now
            time.sleep(calm)
            now = gauges(server)
            if now == expected:
                return now
        if time.monotonic() > deadline:
            return now
        time.sleep(0.05)


class Canary:
    """A greedy completion repeated on its own thread between the fuzz cases: its text must
    never change (no other request's bad input disturbs it)."""

    ROUTE = C
    BODY: ClassVar[dict] = {"prompt": "The canary sings", "max_tokens": 8, "temperature": 0}
    INTERVAL = 0.3  # seconds between its requests

    @staticmethod
    def answer(body: dict) -> str:
        return body["choices"][0]["text"]

    def __init__(self, server):
        self.server, self.lock, self.stop = server, threading.Lock(), threading.Event()
        self.results: list[tuple[int, str]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with within_slow(self.server) as http:
            while not self.stop.is_set():
                with self.lock:
                    try:
                        r = http.post(self.ROUTE, json=self.BODY)
                        text = self.answer(r.json()) if r.status_code == 200 else r.text
                    except httpx.HTTPError as exc:  # a timeout past SLOW, a dropped connection
                        self.results.append((0, repr(exc)))
                    else:
                        self.results.append((r.status_code, text))
                time.sleep(self.INTERVAL)

    @contextlib.contextmanager
    def paused(self):
        with self.lock:
            yield

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serve(tiny_llama[0], *FUZZ_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory, default_tokenizer):
    """tiny_llama's shape with a context long enough that a request outlasts the checks made
    while it runs, on a fast machine too."""
    folder = str(tmp_path_factory.mktemp("long-llama"))
    shape = {**TINY_LLAMA, "max_position_embeddings": 8192}
    reference.tiny_checkpoint(folder, "LlamaForCausalLM", shape, tokenizer=default_tokenizer)
    with serve(folder, *BUSY_ARGS) as s:
        yield s


def _check(server, response: httpx.Response | None, seconds: float, what, shape=OPENAI_ERROR) -> None:
    assert response is not None and response.status_code < 500, (what, response and response.text[:500])
    assert seconds < SLOW, (what, seconds)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == shape and error["message"], (what, error)


def _assert_healthy(server, canary: Canary) -> None:
    assert server.process.poll() is None, "the server exited"
    assert httpx.get(f"{server.url}/health").status_code == 200, "the engine core died"
    assert canary.results, "the canary never ran"
    assert {status for status, _ in canary.results} == {200}, canary.results[:3]
    assert len({text for _, text in canary.results}) == 1, "the canary's greedy text changed"


def test_issue_cases_are_4xx_and_leave_nothing_running(server):
    _run_cases(server, _cases())


def test_bad_images_are_4xx_and_leave_nothing_running(llava_server):
    """Each bad image a 400 on ``messages`` naming it, and no effect on the canary's text."""
    _run_cases(llava_server[0], _image_cases(llava_server[0].model()))


def _run_cases(server, cases) -> None:
    with within_slow(server) as http, Canary(server) as canary:
        for route, body, status, param, *said in cases:
            with canary.paused():
                before = settled(server, (0.0, 0.0))
                started = time.monotonic()
                response = http.post(
                    route, content=body.encode(), headers={"Content-Type": "application/json"}
                )
                shape = ANTHROPIC_ERROR if route.startswith("/v1/messages") else OPENAI_ERROR
                _check(server, response, time.monotonic() - started, body[:120], shape)
                error = response.json()["error"]
                assert response.status_code == status and (param is None or error["param"] == param), (
                    body[:120],
                    response.status_code,
                    error,
                )
                assert all(words in error["message"] for words in said), (said, error["message"])
                assert settled(server, before, calm=0.3) == before, (
                    "an engine request outlived its 4xx",
                    body[:120],
                )
    _assert_healthy(server, canary)


def _response_checks() -> list:
    """schemathesis' checks of an answer against /openapi.json: no 5xx, a declared status,
    content type, headers and body shape, and a 4xx for every request that breaks the schema."""
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    return [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        negative_data_rejection,
    ]


def test_schemathesis_examples(server):
    _fuzz(server, Canary(server), max_examples=120)


class ScoreCanary(Canary):
    """A cross-encoder's score of one pair, alone in the engine each time: it must not move."""

    ROUTE = "/score"
    BODY: ClassVar[dict] = {"text_1": "what is the capital of france?", "text_2": "paris is."}

    @staticmethod
    def answer(body: dict) -> str:
        return f"{body['data'][0]['score']:.5f}"


POOLING_ROUTES = r"^/(v1/|v2/)?(score|rerank|classify|embeddings)$"


@pytest.fixture(scope="module")
def cross_encoder_server(tmp_path_factory):
    from tests.test_score import cross_encoder_checkpoint

    folder = str(tmp_path_factory.mktemp("fuzz-cross-encoder"))
    cross_encoder_checkpoint(folder, id2label={0: "relevant"}, label2id={"relevant": 0})
    with serve(folder, *COMMON_ARGS, "--device", "cpu") as s:
        yield s


def test_schemathesis_pooling_routes_on_a_cross_encoder(cross_encoder_server):
    """The pooling routes (`/score`, `/rerank`, `/classify` in every spelling, and
    `/v1/embeddings`) fuzzed where they score for real: a tiny BERT cross-encoder, whose
    context (64 positions) generated texts overrun; same checks as above, the canary a score."""
    server = cross_encoder_server
    _fuzz(server, ScoreCanary(server), max_examples=80, path_regex=POOLING_ROUTES)


def _fuzz(server, canary: Canary, max_examples: int, path_regex: str | None = None) -> None:
    """schemathesis' positive and negative examples of /openapi.json (its operations under
    ``path_regex``, or all) against ``server``, ``canary`` running between them: no 5xx, none
    slower than :data:`SLOW`, every 4xx an OpenAI-shaped error, nothing left running after one."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis.generation import GenerationMode

    spec = httpx.get(f"{server.url}/openapi.json", headers=server.headers).json()
    schema = schemathesis.openapi.from_dict(spec)
    if path_regex:
        schema = schema.include(path_regex=path_regex)
    cases = st.one_of(
        schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE)
    )
    seen: dict[int, int] = {}
    paths: set[str] = set()
    failures: list[tuple] = []
    checks = _response_checks()

    with canary:

        @settings(
            max_examples=max_examples,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=cases)
        def examples(case):
            with canary.paused():
                before = settled(server, (0.0, 0.0))
                started = time.monotonic()
                response = case.call(base_url=server.url, headers=server.headers, timeout=SLOW)
                seconds = time.monotonic() - started
                shape = ANTHROPIC_ERROR if case.path.startswith("/v1/messages") else OPENAI_ERROR
                _check(server, response, seconds, (case.method, case.path, case.body), shape)
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                paths.add(case.path)
                try:
                    case.validate_response(response, checks=checks)
                except Exception as exc:  # noqa: BLE001 - every check's failure, reported together below
                    failures.append((case.method, case.path, repr(case.body)[:200], str(exc)[:600]))
                if response.status_code >= 400:
                    assert settled(server, before) == before, (case.path, case.body)

        examples()
    assert sum(seen.values()) >= max_examples * 5 // 6 and 200 in seen and 400 in seen, seen
    if path_regex:
        assert len(paths) >= 4, paths  # the examples reached most of the routes, not one
    assert not failures, f"{len(failures)} responses failed schemathesis' checks: {failures[:5]}"
    _assert_healthy(server, canary)
    assert settled(server, (0.0, 0.0), calm=0.5) == (0.0, 0.0)


def _raw_request(server, path: str, body: dict) -> socket.socket:
    """A request sent over a bare socket, so the test decides exactly when the client leaves."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def _finished_length(server) -> float:
    with contextlib.suppress(KeyError):
        return server.metric('vllm:request_success_total{finished_reason="length",model_name="tiny-fuzz"}')
    return 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_aborts_queued_and_decoding_requests(busy_server, stream):
    server = busy_server
    common = {"max_tokens": BUSY_TOKENS, "ignore_eos": True, "stream": stream}
    assert settled(server, (0.0, 0.0)) == (0.0, 0.0)
    finished = _finished_length(server)
    for route, body in ((C, {"prompt": "Go on:", **common}), (CHAT, {"messages": MSG, **common})):
        decoding = [_raw_request(server, route, body) for _ in range(2)]  # --max-num-seqs 2: both run
        assert settled(server, (2.0, 0.0)) == (2.0, 0.0)
        queued = _raw_request(server, route, body)  # waits in the engine, its answer not started
        assert settled(server, (2.0, 1.0)) == (2.0, 1.0)
        queued.close()
        assert settled(server, (2.0, 0.0)) == (2.0, 0.0), "a queued request outlived its client"
        for sock in decoding:
            sock.close()
        assert settled(server, (0.0, 0.0)) == (0.0, 0.0), "a decoding request outlived its client"
    assert _finished_length(server) == finished, "an abandoned request ran to its end"


def test_invalid_schema_is_rejected_at_once_while_the_engine_is_busy(busy_server):
    server = busy_server
    body = {"messages": MSG, "max_tokens": BUSY_TOKENS, "ignore_eos": True}
    busy = [_raw_request(server, CHAT, body) for _ in range(2)]
    try:
        assert settled(server, (2.0, 0.0)) == (2.0, 0.0)
        started = time.monotonic()
        with server.http() as http:
            response = http.post(
                CHAT,
                json={
                    "messages": MSG,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "nope"}},
                    },
                },
            )
        assert response.status_code == 400 and "invalid json schema" in response.json()["error"]["message"]
        assert time.monotonic() - started < 1.0
    finally:
        for sock in busy:
            sock.close()
    assert settled(server, (0.0, 0.0)) == (0.0, 0.0)


def test_heavy_body_is_tokenized_off_the_event_loop(server):
    body = json.dumps({"prompt": "a few words of text " * 175_000}).encode()  # 3.5 MB
    outcome = {}

    def heavy():
        started = time.monotonic()
        with server.http() as http:
            outcome["status"] = http.post(
                "/tokenize", content=body, headers={"Content-Type": "application/json"}
            )
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=heavy)
    thread.start()
    latencies = []
    with httpx.Client(base_url=server.url, timeout=SLOW) as http:
        while thread.is_alive():
            started = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.02)
    thread.join()
    assert outcome["status"].status_code == 200 and outcome["status"].json()["count"] > 100_000
    assert outcome["seconds"] > 1.0 and len(latencies) > 10, outcome
    assert max(latencies) < 0.5, (max(latencies), outcome["seconds"])


def test_exposure_key_content_type_and_streamed_body_limit(server):
    url = server.url
    for method, path in [
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/metrics"),
        ("GET", "/version"),
        ("GET", "/openapi.json"),
        ("GET", "/v1/models"),
        ("POST", C),
    ]:
        response = httpx.request(method, f"{url}{path}", json={"prompt": "hi", "tokens": [1]})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.get(f"{url}/health").status_code == 200
    with server.http() as http:
        model = http.get("/v1/models").json()["data"][0]
        assert model["id"] == model["root"] == "tiny-fuzz" and "/" not in json.dumps(model)
        plain = http.post(C, content=json.dumps({"prompt": "hi"}), headers={"Content-Type": "text/plain"})
        assert plain.status_code == 415
        form = http.post(C, data={"prompt": "hi"})
        assert form.status_code == 415

        def chunks():  # chunked transfer: no Content-Length to refuse up front
            for _ in range(6):
                yield b'{"prompt": "' + b"x" * 2**20

        big = http.post(C, content=chunks(), headers={"Content-Type": "application/json"})
        assert big.status_code == 413 and "exceeds the limit" in big.json()["error"]["message"]
        ok = http.post(C, json={"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 2, "n": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_logprobs_of_masked_tokens_are_valid_json(server):
    """Under a grammar most alternatives are masked (-inf): they report a floor, never -Infinity."""
    body = {"prompt": "hi", "guided_choice": ["yes", "no"], "logprobs": 5, "max_tokens": 3}
    with within_slow(server) as http:
        whole = http.post(C, json=body)
        assert whole.status_code == 200, whole.text
        top = _strict_json(whole.text)["choices"][0]["logprobs"]["top_logprobs"]
        assert min(v for entry in top for v in entry.values()) == -9999.0
        with http.stream("POST", C, json={**body, "stream": True}) as stream:
            frames = [line[6:] for line in stream.iter_lines() if line.startswith("data: {")]
        assert frames and all(_strict_json(frame) for frame in frames)
        chat = http.post(
            CHAT,
            json={
                "messages": MSG,
                "guided_choice": ["yes", "no"],
                "logprobs": True,
                "top_logprobs": 5,
                "max_tokens": 3,
            },
        )
        assert chat.status_code == 200 and _strict_json(chat.text)["choices"][0]["logprobs"]["content"]
