"""Per-request timings in the response (``"timings": true`` in the request, or
``--enable-request-timings`` for every one): llama.cpp's ``timings`` object, so tools that
read it from llama.cpp's server read it here, plus the engine's queue time and the time to
the first token.

Made from the timings the metrics already take per sample. ``prompt_n`` counts the prompt
tokens computed, ``cache_n`` those the prefix cache held; ``prompt_ms`` is the engine core's
prefill time. ``predicted_n`` counts every sample's tokens and ``predicted_ms`` spans the
longest decode (first token to last), so with ``n`` > 1 ``predicted_per_second`` is the
request's total rate, as the samples decode side by side."""

from __future__ import annotations


def request_timings(generation) -> dict[str, float | int]:
    timers = [
        generation.timers[c.request_id] for c in generation.choices if c.request_id in generation.timers
    ]
    answered = [t for t in timers if t.first_token is not None]
    prompt_tokens = sum(len(ids) for _, ids in generation.prompts)
    cached = sum(c.num_cached_tokens for c in generation.choices[:: generation.body.n])
    queue = max((t.timing[0] for t in answered if t.timing), default=0.0)
    prefill = max((t.timing[1] for t in answered if t.timing), default=0.0)
    decode = max((t.last - t.first_token for t in answered), default=0.0)
    predicted = sum(len(c.token_ids) for c in generation.choices)
    computed = prompt_tokens - cached
    return {
        "queue_ms": queue * 1e3,
        "ttft_ms": max((t.first_token - t.start for t in answered), default=0.0) * 1e3,
        "cache_n": cached,
        "prompt_n": computed,
        "prompt_ms": prefill * 1e3,
        "prompt_per_token_ms": prefill * 1e3 / computed if computed else 0.0,
        "prompt_per_second": computed / prefill if prefill else 0.0,
        "predicted_n": predicted,
        "predicted_ms": decode * 1e3,
        "predicted_per_token_ms": decode * 1e3 / predicted if predicted else 0.0,
        "predicted_per_second": predicted / decode if decode else 0.0,
    }
