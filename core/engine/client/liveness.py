"""The front end's side of liveness: what the core's heartbeats (:mod:`engine.client.heartbeat`)
say of its progress, judged against a limit.

A core is judged only while it has requests in flight: an idle core has nothing to be late
with. It is then unresponsive when its step loop was last seen beginning a round longer ago
than the limit, which happens in two ways:

- no heartbeat comes: its whole process is stopped (SIGSTOP, a debugger) or a native call
  holds the GIL, so not even the heartbeat thread runs; or
- the heartbeats come but report one round of the step loop older than the limit: the
  process runs and its step loop does not (a deadlocked step, a collective that never ends).

A legitimately long step is the second case too: the limit must exceed the longest step the
deployment expects (the prefill share of a step is sized to a time target, so steps stay short)."""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.client.protocol import HEARTBEAT_INTERVAL, Heartbeat


class Liveness:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        """Counts from now, as if a beat had just come: the core was ready a moment ago."""
        self._clock = clock
        self.received_at = clock()
        self.last = Heartbeat(0.0, 0, False)

    def record(self, beat: Heartbeat) -> None:
        self.received_at = self._clock()
        self.last = beat

    def silence(self) -> float:
        """Seconds since the last heartbeat came."""
        return self._clock() - self.received_at

    def round_age(self) -> float:
        """Seconds since the step loop was last seen beginning a round: the last beat's round
        age, plus the silence since (nothing newer says the round ended)."""
        return self.last.round_age + self.silence()

    def problem(self, limit: float, in_flight: int) -> str | None:
        """Why the core counts as unresponsive under ``limit`` seconds, or None: its step loop
        was last seen beginning a round longer ago than that. The reason says whether the
        heartbeats stopped too (missing two is no jitter) or still come."""
        if not in_flight:
            return None
        age = self.round_age()
        if age <= limit:
            return None
        requests = f"{in_flight} request is" if in_flight == 1 else f"{in_flight} requests are"
        silence = self.silence()
        if silence > 2 * HEARTBEAT_INTERVAL:
            return (
                f"engine core sent no heartbeat for {silence:.1f} s (its process is stopped or frozen) "
                f"while {requests} in flight"
            )
        where = "one step" if self.last.stepping else "one round of its step loop"
        return (
            f"engine core has been in {where} for {age:.1f} s while {requests} in flight "
            f"(after {self.last.steps} steps; its heartbeats still come, its step loop does not progress)"
        )
