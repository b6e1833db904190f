"""The soak's other clients, beside the plain streams of `soak.py`: greedy canaries whose every
answer must equal their first, clients that hang up mid-stream, and clients that send bad
input and must get a clear 4xx. Each runs until the deadline and records into a :class:`Mix`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

CANARY_PROMPTS = ("Name three colors.", "Count from one to ten.", "What is the capital of France?")
CANARY_TOKENS = 16
DISCONNECT_AFTER_FRAMES = 3
BAD_INPUT_PAUSE = 0.1  # seconds between one bad-input client's requests: a mix, not a flood
PAUSE_AFTER_ERROR = 1.0  # seconds a client waits after an unexpected answer, rather than spin


def bad_requests(model: str) -> list[tuple[str, str, bytes | dict]]:
    """(route, what is wrong, body): each must be answered 4xx with an OpenAI-shaped error."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
    return [
        ("/v1/completions", "invalid JSON", b'{"model": '),
        ("/v1/completions", "negative max_tokens", {"model": model, "prompt": "Hi", "max_tokens": -1}),
        ("/v1/completions", "unknown model", {"model": "no-such-model", "prompt": "Hi"}),
        ("/v1/completions", "token id past the vocabulary", {"model": model, "prompt": [10**9]}),
        ("/v1/completions", "too many logprobs", {"model": model, "prompt": "Hi", "logprobs": 10**6}),
        ("/v1/chat/completions", "no messages", {"model": model}),
        ("/v1/chat/completions", "temperature as a word", {**chat, "temperature": "hot"}),
        ("/v1/chat/completions", "n of a million", {**chat, "n": 10**6}),
    ]


@dataclass
class Mix:
    """What the canaries, disconnecting and bad-input clients saw."""

    canary_answers: int = 0
    canary_references: dict[str, tuple] = field(default_factory=dict)  # prompt -> first answer
    canary_mismatches: list[str] = field(default_factory=list)
    disconnects: int = 0
    bad_inputs: int = 0
    errors: list[str] = field(default_factory=list)  # unexpected: each one fails the soak

    def summary(self) -> str:
        return (
            f"canaries {self.canary_answers} answers, {len(self.canary_mismatches)} differing; "
            f"{self.disconnects} disconnects; {self.bad_inputs} bad inputs refused"
        )

    def failures(self) -> list[str]:
        failures = [f"{len(self.errors)} unexpected answers, e.g. {self.errors[:3]}"] if self.errors else []
        if self.canary_mismatches:
            failures.append(
                f"{len(self.canary_mismatches)} canary answers differ from the first, e.g. "
                f"{self.canary_mismatches[:2]}"
            )
        return failures


async def canary(client: httpx.AsyncClient, model: str, index: int, mix: Mix, deadline: float) -> None:
    """One greedy chat request again and again: its tokens and log-probs must never change,
    whether its prompt is served from the prefix cache or not and whatever runs beside it."""
    prompt = CANARY_PROMPTS[index % len(CANARY_PROMPTS)]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": CANARY_TOKENS,
        "logprobs": True,
    }
    while time.monotonic() < deadline:
        response = await client.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            mix.errors.append(f"canary: {response.status_code} {response.text[:200]}")
            await asyncio.sleep(PAUSE_AFTER_ERROR)
            continue
        choice = response.json()["choices"][0]
        answer = (
            choice["message"]["content"],
            tuple((t["token"], t["logprob"]) for t in choice["logprobs"]["content"]),
        )
        mix.canary_answers += 1
        reference = mix.canary_references.setdefault(prompt, answer)
        if answer != reference:
            mix.canary_mismatches.append(f"{prompt!r}: {first_difference(reference[1], answer[1])}")


def first_difference(reference: tuple, answer: tuple) -> str:
    """Where a canary's (token, log-prob) pairs first leave its reference's."""
    pairs = enumerate(zip(reference, answer))
    at = next((i for i, (a, b) in pairs if a != b), min(len(reference), len(answer)))
    return f"token {at}: {answer[at : at + 1]} after {reference[at : at + 1]}"


async def disconnecter(
    client: httpx.AsyncClient, model: str, max_tokens: int, mix: Mix, deadline: float
) -> None:
    """Streams that the client abandons after a few frames: the engine must free them."""
    body = {"model": model, "prompt": "Tell a long story.", "max_tokens": max_tokens, "stream": True}
    while time.monotonic() < deadline:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                mix.errors.append(
                    f"disconnecting stream: {response.status_code} {(await response.aread())[:200]!r}"
                )
                await asyncio.sleep(PAUSE_AFTER_ERROR)
                continue
            frames = 0
            async for line in response.aiter_lines():
                frames += line.startswith("data: ")
                if frames == DISCONNECT_AFTER_FRAMES:
                    break
        mix.disconnects += 1


async def bad_input(client: httpx.AsyncClient, model: str, index: int, mix: Mix, deadline: float) -> None:
    """Malformed requests in turn: each must get a 4xx carrying ``error.message``, never a
    5xx, a 2xx or a dropped connection."""
    cases = bad_requests(model)
    i = index
    while time.monotonic() < deadline:
        route, wrong, body = cases[i % len(cases)]
        i += 1
        if isinstance(body, bytes):
            response = await client.post(route, content=body, headers={"Content-Type": "application/json"})
        else:
            response = await client.post(route, json=body)
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = None
        if not 400 <= response.status_code < 500 or not message:
            mix.errors.append(f"bad input ({wrong}): {response.status_code} {response.text[:200]}")
        else:
            mix.bad_inputs += 1
        await asyncio.sleep(BAD_INPUT_PAUSE)
