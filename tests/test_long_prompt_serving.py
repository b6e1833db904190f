"""A long prompt arriving while other streams decode on a real `engine serve` (the default
model, kept quantized): the streams keep getting tokens — their inter-token gap stays
bounded while the prompt prefills — and the long request completes."""

from __future__ import annotations

import itertools
import statistics
import threading
import time

import pytest

from tests.conftest import native_affine_missing
from tests.serving import serve

# the bound was measured with the cpu-native C kernels; without them (an AVX2-only CPU) the 8k
# prefill alone outlasts the client's timeout (over 10 minutes): issue 24
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(native_affine_missing()), reason=native_affine_missing()),
]

PROMPT_TOKENS = 8000  # the acceptance case: an 8k-token prompt beside decoding streams
STREAMS = 3
# Measured on this machine with nothing else running: p99 0.32 s over ~600 gaps while the 8k
# prompt prefilled in ~49 s (benchmarks/prefill.py records the same against llama.cpp); the
# bound is the 1 s, three times that.
P99_BOUND_S = 1.0


def _stream(client, model, stamps: list[float], stop: threading.Event) -> None:
    stream = client.completions.create(
        model=model,
        prompt="Count upwards: 1, 2, 3,",
        max_tokens=4000,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    with stream:
        for _ in stream:
            stamps.append(time.monotonic())
            if stop.is_set():
                break


def test_streams_keep_flowing_while_a_long_prompt_prefills():
    with serve(None, "--max-model-len", "8192", api_key=None) as server:
        client = server.openai()
        model = client.models.list().data[0].id
        with server.http() as http:
            prompt = http.post("/tokenize", json={"model": model, "prompt": "the sea and the keeper " * 2000})
            ids = prompt.json()["tokens"][:PROMPT_TOKENS]
        stamps = [[] for _ in range(STREAMS)]
        stop = threading.Event()
        threads = [threading.Thread(target=_stream, args=(client, model, s, stop)) for s in stamps]
        for t in threads:
            t.start()
        while min(len(s) for s in stamps) < 5:  # every stream is decoding
            time.sleep(0.05)
        started = time.monotonic()
        long = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0)
        finished = time.monotonic()
        stop.set()
        for t in threads:
            t.join(60)
    assert long.usage.prompt_tokens == PROMPT_TOKENS and long.choices[0].finish_reason == "length"
    gaps = [b - a for s in stamps for a, b in itertools.pairwise(s) if started <= b <= finished]
    assert len(gaps) > 20, "the streams got hardly any tokens while the prompt prefilled"
    p99 = statistics.quantiles(gaps, n=100, method="inclusive")[98]
    print(
        f"\np99 inter-token gap {p99:.2f} s over {len(gaps)} gaps; "
        f"{PROMPT_TOKENS}-token prefill {finished - started:.1f} s"
    )
    assert p99 < P99_BOUND_S, (
        f"p99 inter-token gap {p99:.2f} s over {len(gaps)} gaps, prefill {finished - started:.1f} s"
    )
