"""The prefill share of a step while other requests decode, sized online to a target step time.

Chunked prefill alone does not keep decode rows flowing: running requests are served first,
but a step that carries a long prompt's 2048-token chunk takes as long as that chunk, and
every stream waits for it. How long a chunk takes depends on the machine, its load, the
model and — through attention — on how much context the chunk attends over (on two CPU
cores a prefill token at 8k context costs several times one at the start). No fixed token
count bounds that, so the share is measured: after each step that carried prefill tokens
beside decode rows, the share is scaled by target / measured time (at most ×2 up, ×1/8
down), the way Sarathi-Serve sizes its budget from a latency target, but from the steps
as they run rather than an offline profile. A step with no decode row running gets the
whole token budget (a prompt alone is prefilled at full speed).
"""

from __future__ import annotations

import time

MIN_SHARE = 16  # tokens: a prefill keeps moving even when decode rows alone exceed the target
FIRST_SHARE = 32  # before any step has been measured


class PrefillShare:
    """One scheduler's prefill share: ``begin`` each step, ``take`` for each prefill chunk,
    ``end`` once the step has run."""

    def __init__(self, target_s: float, budget: int):
        self.target_s = target_s
        self.budget = budget
        self.tokens = min(FIRST_SHARE, budget)  # the share of a step with decode rows, learned
        self._left = budget
        self._taken = 0
        self._started: float | None = None

    def begin(self, decoding: bool) -> None:
        """A new step; ``decoding``: some running request is generating (a stream waits)."""
        self._taken = 0
        if not decoding or not self.target_s:
            self._started, self._left = None, self.budget
        else:
            self._started, self._left = time.monotonic(), self.tokens

    def take(self, num_tokens: int) -> int:
        """Up to ``num_tokens`` of prefill out of what is left of this step's share."""
        granted = min(num_tokens, self._left)
        self._left -= granted
        self._taken += granted
        return granted

    def end(self) -> None:
        """After the step ran: learn from its duration when the share bound it (so more might
        fit) or the step overran the target."""
        if self._started is None or not self._taken:
            return
        elapsed = max(time.monotonic() - self._started, 1e-6)
        if self._taken < self.tokens and elapsed <= self.target_s:
            return  # the share was not the limit and the step was fast: nothing learned
        ratio = min(2.0, max(0.125, self.target_s / elapsed))
        self.tokens = min(self.budget, max(MIN_SHARE, round(self._taken * ratio)))
