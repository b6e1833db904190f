"""Prefix-cache counters published in whole windows, not per engine step.

With the counters updated every step, a client alone on the server could read /metrics
before and after one request and learn whether its guessed prompt was already cached by
someone else. Held back to one update per window, the counters move by the sum over every
request in the window. This narrows the channel; it does not close it (an idle server's
window may hold one request, and time to first token shows cache hits too): tenants that
must not learn about each other's prompts get distinct ``cache_salt`` values, and /metrics
sits behind ``--api-key``."""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs

from engine.messages.stats import EngineStats

PREFIX_WINDOW_SECONDS = 30.0


class PrefixCacheWindow:
    """Wraps a stats listener: all stats pass through, with the prefix-cache totals
    replaced by those of the last window boundary."""

    def __init__(
        self,
        listener: Callable[[EngineStats], None],
        window: float = PREFIX_WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.listener, self.window, self.clock = listener, window, clock
        self._published = {"prefix_queries": 0, "prefix_hits": 0}
        self._boundary = clock()

    def __call__(self, stats: EngineStats) -> None:
        now = self.clock()
        if now - self._boundary >= self.window:
            self._published = {"prefix_queries": stats.prefix_queries, "prefix_hits": stats.prefix_hits}
            self._boundary = now
        self.listener(attrs.evolve(stats, **self._published))
