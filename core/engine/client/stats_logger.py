"""``--log-stats``: one line of engine statistics every ``LOG_INTERVAL_S`` while the engine steps,
as vLLM logs them: prompt and generation throughput over the interval, the requests running
and waiting, the KV cache's use and the prefix cache's hit rate over the interval.

The line is logged at INFO on this module's logger, which the option turns on; where the
program set up no logging at all it goes to standard error, so asking for it always shows it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.messages.stats import EngineStats

LOG_INTERVAL_S = 10.0  # vLLM's default (VLLM_LOG_STATS_INTERVAL)

logger = logging.getLogger(__name__)


class StatsLogger:
    def __init__(
        self,
        label: str = "engine",
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``interval``: seconds between lines (None: ``LOG_INTERVAL_S``)."""
        self.label, self.clock = label, clock
        self.interval = LOG_INTERVAL_S if interval is None else interval
        self._last = EngineStats()
        self._since = clock()
        logger.setLevel(logging.INFO)
        if not logger.hasHandlers():
            logger.addHandler(logging.StreamHandler())

    def tick(self, stats: Callable[[], EngineStats]) -> None:
        """Log a line once the interval has passed; ``stats`` is called only then."""
        now = self.clock()
        if now - self._since >= self.interval:
            current = stats()
            logger.info("%s", stats_line(self.label, self._last, current, now - self._since))
            self._last, self._since = current, now


def stats_line(label: str, before: EngineStats, now: EngineStats, seconds: float) -> str:
    """The line for the ``seconds`` from ``before`` to ``now``."""
    queries = now.prefix_queries - before.prefix_queries
    hit_rate = (now.prefix_hits - before.prefix_hits) / queries if queries else 0.0
    prompt = (now.prompt_tokens - before.prompt_tokens) / seconds
    generation = (now.generation_tokens - before.generation_tokens) / seconds
    return (
        f"{label}: prompt throughput {prompt:.1f} tokens/s, generation throughput "
        f"{generation:.1f} tokens/s, running {now.running} reqs, waiting {now.waiting} reqs, "
        f"KV cache usage {now.kv_cache_usage:.1%}, prefix cache hit rate {hit_rate:.1%}"
    )
