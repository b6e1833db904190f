"""What `engine bench serve` sends: random prompts of exact token lengths, a ShareGPT-format
JSON file, or a JSON-lines file of ``{"prompt": ..., "output_len": ...}``.

Token counts come from the server under test (``/tokenize`` and ``/detokenize``, which vLLM
serves too), so no tokenizer has to be installed beside the benchmark and the lengths are
the server's own; ``--tokenizer`` (as vLLM's client takes it) counts with a local one instead.
"""

from __future__ import annotations

import json
import random

import attrs
import httpx

_WORDS = (
    "time",
    "person",
    "year",
    "way",
    "day",
    "thing",
    "man",
    "world",
    "life",
    "hand",
    "part",
    "child",
    "eye",
    "woman",
    "place",
    "work",
    "week",
    "case",
    "point",
    "government",
    "company",
    "number",
    "group",
    "problem",
    "fact",
    "be",
    "have",
    "do",
    "say",
    "get",
    "make",
    "go",
    "know",
    "take",
    "see",
    "come",
    "think",
    "look",
    "want",
    "give",
    "use",
    "find",
    "tell",
    "ask",
    "seem",
    "feel",
    "try",
    "leave",
    "call",
    "good",
    "new",
    "first",
    "last",
    "long",
    "great",
    "little",
    "own",
    "other",
    "old",
    "right",
    "big",
    "high",
    "different",
    "small",
    "large",
    "next",
    "early",
    "young",
    "important",
    "few",
    "public",
    "bad",
    "same",
    "able",
)


@attrs.frozen
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (sent as is to /v1/completions)
    prompt_len: int
    output_len: int


class Tokens:
    """The server's tokenizer over HTTP."""

    def __init__(self, client: httpx.AsyncClient, model: str):
        self.client, self.model = client, model

    async def encode(self, text: str) -> list[int]:
        response = await self.client.post(
            "/tokenize", json={"model": self.model, "prompt": text, "add_special_tokens": False}
        )
        response.raise_for_status()
        return response.json()["tokens"]

    async def decode(self, ids: list[int]) -> str:
        response = await self.client.post("/detokenize", json={"model": self.model, "tokens": ids})
        response.raise_for_status()
        return response.json()["prompt"]


class LocalTokens:
    """A tokenizer folder loaded with ``transformers`` (``--tokenizer``)."""

    def __init__(self, name_or_path: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)

    async def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    return max(1, round(rng.uniform(mean * (1 - range_ratio), mean * (1 + range_ratio))))


async def random_requests(tokens: Tokens, args, as_text: bool) -> list[SampleRequest]:
    """Prompts of ``--random-input-len`` tokens (±``--random-range-ratio``) after a shared
    ``--random-prefix-len`` prefix, cut from a pool of the server's tokens for English words."""
    rng = random.Random(args.seed)
    lengths = [
        (
            _length(rng, args.random_input_len, args.random_range_ratio),
            _length(rng, args.random_output_len, args.random_range_ratio),
        )
        for _ in range(args.num_prompts)
    ]
    needed = args.random_prefix_len + max(n for n, _ in lengths)
    pool = await tokens.encode(" ".join(rng.choice(_WORDS) for _ in range(needed + 16)))
    while len(pool) < needed + 1:
        pool += pool
    prefix = pool[: args.random_prefix_len]
    requests = []
    for input_len, output_len in lengths:
        start = rng.randrange(0, len(pool) - input_len + 1)
        ids = prefix + pool[start : start + input_len]
        requests.append(SampleRequest(await tokens.decode(ids) if as_text else ids, len(ids), output_len))
    return requests


async def sharegpt_requests(tokens: Tokens, args) -> list[SampleRequest]:
    """The first human turn of each conversation as the prompt; the first reply's token count
    as the output length (or ``--sharegpt-output-len``). Too-short and too-long pairs are
    skipped as vLLM does (prompt or reply under 4 tokens, prompt over 1024 or the pair over 2048)."""
    conversations = [
        c["conversations"]
        for c in json.loads(_read(args.dataset_path))
        if len(c.get("conversations", [])) >= 2
    ]
    random.Random(args.seed).shuffle(conversations)
    requests = []
    for turns in conversations:
        if len(requests) == args.num_prompts:
            break
        prompt = turns[0]["value"]
        prompt_len = len(await tokens.encode(prompt))
        output_len = args.sharegpt_output_len or len(await tokens.encode(turns[1]["value"]))
        if prompt_len < 4 or output_len < 4 or prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        requests.append(SampleRequest(prompt, prompt_len, output_len))
    if not requests:
        raise ValueError(f"--dataset-path {args.dataset_path}: no usable ShareGPT conversation")
    return requests


async def custom_requests(tokens: Tokens, args) -> list[SampleRequest]:
    """A JSON-lines file of ``{"prompt": TEXT, "output_len": N}`` (output_len optional)."""
    rows = [json.loads(line) for line in _read(args.dataset_path).splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"--dataset-path {args.dataset_path}: no rows")
    requests = []
    for i in range(args.num_prompts):
        row = rows[i % len(rows)]
        prompt_len = len(await tokens.encode(row["prompt"]))
        requests.append(
            SampleRequest(row["prompt"], prompt_len, int(row.get("output_len", args.random_output_len)))
        )
    return requests


async def sample_requests(tokens: Tokens, args, chat: bool) -> list[SampleRequest]:
    if args.dataset_name == "random":
        return await random_requests(tokens, args, as_text=chat)
    if not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.dataset_name == "sharegpt":
        return await sharegpt_requests(tokens, args)
    return await custom_requests(tokens, args)
