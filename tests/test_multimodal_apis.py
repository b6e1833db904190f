"""Images on /v1/messages (Anthropic image blocks) and /v1/responses (``input_image`` parts),
driven by the official `anthropic` and `openai` clients against the session's tiny LLaVA
server: each route reads its images through the chat route's reader (the same fetching and
limits), so the same image and text give the chat route's greedy answer, and a bad image is the
route's own 400."""

from __future__ import annotations

import base64

import anthropic
import openai
import pytest

from engine.testing.multimodal import random_image
from tests.test_multimodal_server import data_url, png

MAX_TOKENS = 6
TEXT = "look "


@pytest.fixture(scope="module")
def clients(llava_server):
    """(openai client, anthropic client), closed before the server stops."""
    server = llava_server[0]
    claude = anthropic.Anthropic(base_url=server.url, api_key=server.api_key or "none", max_retries=0)
    with server.openai() as oai, claude:
        yield oai, claude


def chat_text(client, model: str, url: str) -> str:
    parts = [{"type": "text", "text": TEXT}, {"type": "image_url", "image_url": {"url": url}}]
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": parts}], max_tokens=MAX_TOKENS, temperature=0
    )
    return response.choices[0].message.content


def image_turn(source: dict) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "text", "text": TEXT}, {"type": "image", "source": source}]}
    ]


def messages_text(client, model: str, source: dict) -> str:
    response = client.messages.create(
        model=model, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=image_turn(source)
    )
    return "".join(block.text for block in response.content if block.type == "text")


def base64_source(image) -> dict:
    return {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(image)).decode()}


def test_messages_images_answer_as_the_chat_route(llava_server, clients):
    server, media = llava_server
    oai, claude = clients
    image = random_image(61)
    (media / "messages.png").write_bytes(png(image))
    expected = chat_text(oai, server.model(), data_url(image))
    assert expected  # the tiny model answers something
    assert messages_text(claude, server.model(), base64_source(image)) == expected
    file_url = {"type": "url", "url": f"file://{media}/messages.png"}  # --allowed-local-media-path
    assert messages_text(claude, server.model(), file_url) == expected
    counted = claude.messages.count_tokens(model=server.model(), messages=image_turn(base64_source(image)))
    assert counted.input_tokens > 16  # the image's 16 placeholder tokens are counted
    other = messages_text(claude, server.model(), base64_source(random_image(62, (40, 70))))
    assert other == chat_text(oai, server.model(), data_url(random_image(62, (40, 70))))


def test_responses_images_answer_as_the_chat_route(llava_server, clients):
    server, _ = llava_server
    oai, _ = clients
    image = random_image(63)
    content = [{"type": "input_text", "text": TEXT}, {"type": "input_image", "image_url": data_url(image)}]
    response = oai.responses.create(
        model=server.model(),
        input=[{"role": "user", "content": content}],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert response.output_text == chat_text(oai, server.model(), data_url(image))


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ({"type": "base64", "media_type": "image/png", "data": "not base64!"}, "not valid base64"),
        (
            {"type": "base64", "media_type": "image/png", "data": base64.b64encode(b"text").decode()},
            "not an image",
        ),
        ({"type": "base64", "media_type": "text/plain", "data": "aGk="}, "media_type"),
        ({"type": "url", "url": "https://example.com/cat.png"}, "allowed-media-domains"),
        ({"type": "file", "file_id": "f"}, "source must be"),
    ],
)
def test_bad_message_images_are_anthropic_400s(llava_server, clients, source, says):
    server, _ = llava_server
    _, claude = clients
    with pytest.raises(anthropic.BadRequestError) as caught:
        messages_text(claude, server.model(), source)
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert says in error["error"]["message"]


@pytest.mark.parametrize(
    ("part", "says"),
    [
        ({"type": "input_image", "image_url": "data:image/png;base64,AAAA"}, "not an image"),
        ({"type": "input_image", "image_url": "ftp://example.com/cat.png"}, "'ftp' URL"),
        ({"type": "input_image", "file_id": "file-1"}, "file_id"),
    ],
)
def test_bad_response_images_are_openai_400s(llava_server, clients, part, says):
    server, _ = llava_server
    oai, _ = clients
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(
            model=server.model(), input=[{"role": "user", "content": [part]}], max_output_tokens=2
        )
    assert says in caught.value.body["message"] and caught.value.body["param"] == "input"
