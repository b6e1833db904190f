"""Images over HTTP (issue 28): a real `engine serve` of a tiny random LLaVA driven by the
official `openai` client. Base64 images give `transformers`' greedy tokens while text streams
run beside them; the same image again is served from the prefix cache with no encoder run
(/metrics); file: and http(s) image URLs are read only where the flags allow. Bad images are
the fuzz suite's (tests/test_fuzz_server.py)."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import http.server
import io
import json
import os
import socket
import threading
import time

import httpx
import pytest
import torch

from engine.testing.multimodal import random_image
from tests.serving import Streams

NEW_TOKENS = 6


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def image_message(url: str, text: str = "look ") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]


def chat_token_ids(client, model: str, messages: list[dict]):
    """(greedy token ids, usage) of a chat completion, the ids read from its logprobs."""
    response = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=NEW_TOKENS,
        temperature=0,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    ids = [int(entry.token.removeprefix("token_id:")) for entry in response.choices[0].logprobs.content]
    return ids, response.usage


def transformers_greedy(server, tiny_llava, messages: list[dict], image) -> list[int]:
    """`transformers`' greedy tokens for the prompt the server reads (/tokenize with the image
    parts: the placeholders widened) and the image's pixels from the checkpoint's processor."""
    _, model, processor = tiny_llava
    body = {"model": server.model(), "messages": messages}
    prompt = httpx.post(f"{server.url}/tokenize", json=body, headers=server.headers).json()["tokens"]
    pixels = processor.image_processor(images=[image.convert("RGB")], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            pixel_values=pixels,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def client(llava_server):
    """The official client, closed before the server stops (an open keep-alive connection
    holds a graceful shutdown)."""
    with llava_server[0].openai() as client:
        yield client


def stream_text(frames: list[str]) -> str:
    chunks = [json.loads(frame) for frame in frames if frame.startswith("{")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", frames[-3:]
    return "".join(chunk["choices"][0]["text"] for chunk in chunks)


def test_base64_images_beside_text_streams_match_transformers(llava_server, client, tiny_llava):
    server, _ = llava_server
    model = server.model()
    text_body = {"prompt": "Hello", "max_tokens": 30, "temperature": 0}
    alone = stream_text(Streams(server, 1, **text_body).join()[0])
    images = [random_image(21), random_image(22, (40, 70))]
    streams = Streams(server, 2, **text_body)
    streams.wait_started()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(
            pool.map(lambda im: chat_token_ids(client, model, image_message(data_url(im))), images)
        )
    assert [stream_text(frames) for frames in streams.join()] == [alone, alone]
    for image, (ids, usage) in zip(images, answers):
        assert ids == transformers_greedy(server, tiny_llava, image_message(data_url(image)), image)
        assert usage.prompt_tokens > 16  # the image's 16 placeholder tokens are prompt tokens


def test_the_same_image_again_hits_the_prefix_cache_and_runs_no_encoder(llava_server, client):
    server, _ = llava_server
    model = server.model()
    messages = image_message(data_url(random_image(31)), "again and ")
    first, first_usage = chat_token_ids(client, model, messages)
    runs = server.metric("vllm:mm_encoder_runs_total")
    second, usage = chat_token_ids(client, model, messages)
    assert second == first
    assert first_usage.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens_details.cached_tokens >= 24  # whole 8-token blocks, the image's among them
    assert server.metric("vllm:mm_encoder_runs_total") == runs


def error_of(server, url: str) -> tuple[int, str]:
    body = {"model": server.model(), "messages": image_message(url), "max_tokens": 2}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=30)
    return response.status_code, response.json()["error"]["message"] if response.status_code != 200 else ""


def test_file_urls_only_inside_the_allowed_folder(llava_server, client, tmp_path):
    server, media = llava_server
    image = random_image(41)
    (media / "cat.png").write_bytes(png(image))
    outside = tmp_path / "secret.png"
    outside.write_bytes(png(image))
    os.symlink(outside, media / "link.png")
    model = server.model()
    as_file = chat_token_ids(client, model, image_message(f"file://{media}/cat.png"))[0]
    assert as_file == chat_token_ids(client, model, image_message(data_url(image)))[0]
    for url in (
        f"file://{outside}",
        f"file://{media}/../{outside.parent.name}/secret.png",
        f"file://{media}/link.png",
    ):
        assert error_of(server, url) == (
            400,
            "image_url: the file: URL leads outside allowed_local_media_path",
        )
    assert error_of(server, f"file://{media}/none.png")[0] == 400


class _Images(http.server.BaseHTTPRequestHandler):
    """/cat.png: a PNG; /moved: a redirect; /big: more than --max-media-bytes; /slow: a byte
    every 0.2 s for 2.4 s (each read within the socket timeout, the whole past the fetch's)."""

    body = b""

    def do_GET(self):
        if self.path == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(12):
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(0.2)
            return
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        payload = self.body if self.path == "/cat.png" else b"\0" * (65 * 1024)
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def local_http(body: bytes):
    handler = type("Handler", (_Images,), {"body": body})
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            yield httpd.server_address[1]
        finally:
            httpd.shutdown()


def test_http_urls_only_from_allowed_hosts_without_redirects_within_limits(llava_server, client):
    """127.0.0.1 is in --allowed-media-domains; localhost (the same server) is not."""
    server, _ = llava_server
    image = random_image(51)
    model = server.model()
    with local_http(png(image)) as port, socket.create_server(("127.0.0.1", 0)) as silent:
        fetched = chat_token_ids(client, model, image_message(f"http://127.0.0.1:{port}/cat.png"))[0]
        assert fetched == chat_token_ids(client, model, image_message(data_url(image)))[0]
        status, message = error_of(server, f"http://localhost:{port}/cat.png")
        assert (status, message.split(";")[0]) == (400, "image_url: fetching from 'localhost' is not allowed")
        assert error_of(server, f"http://127.0.0.1:{port}/moved") == (
            400,
            "image_url: the server of the URL answered with a redirect (302)",
        )
        assert error_of(server, f"http://127.0.0.1:{port}/big") == (
            400,
            "image_url: the image is larger than 65536 bytes",
        )
        status, message = error_of(server, f"http://127.0.0.1:{silent.getsockname()[1]}/cat.png")
        assert status == 400 and "timed out" in message, message
        started = time.monotonic()
        assert error_of(server, f"http://127.0.0.1:{port}/slow") == (
            400,
            "image_url: fetching the URL timed out",
        )
        assert time.monotonic() - started < 2.0  # --media-fetch-timeout 1 bounds the whole fetch
    assert error_of(server, f"http://127.0.0.1:{port}/cat.png")[0] == 400  # gone: refused, not hung
