"""Tokens per engine step, as a cumulative histogram the core keeps and reports in its
stats (vLLM's ``iteration_tokens_total``): a bisect and two additions per step."""

from __future__ import annotations

import bisect

# upper bounds (tokens in one step), as vLLM's iteration_tokens_total buckets
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREFIX = "iteration_tokens"


class StepTokenHistogram:
    def __init__(self, buckets: tuple[int, ...] = STEP_TOKEN_BUCKETS):
        self.buckets = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self._sum = 0

    def observe(self, num_tokens: int) -> None:
        self._counts[bisect.bisect_left(self.buckets, num_tokens)] += 1
        self._sum += num_tokens

    def stats(self) -> dict[str, float]:
        """``iteration_tokens_bucket:<le>`` (cumulative, ``+Inf`` last), ``_sum``, ``_count``."""
        out, running = {}, 0
        for bound, count in zip((*map(str, self.buckets), "+Inf"), self._counts):
            running += count
            out[f"{PREFIX}_bucket:{bound}"] = running
        out[f"{PREFIX}_sum"] = self._sum
        out[f"{PREFIX}_count"] = running
        return out


def step_token_buckets(stats: dict[str, float]) -> list[tuple[str, float]]:
    """The (le, cumulative count) pairs of a stats dict from :meth:`StepTokenHistogram.stats`."""
    prefix = f"{PREFIX}_bucket:"
    return [(key[len(prefix) :], value) for key, value in stats.items() if key.startswith(prefix)]
