"""Results: what the transport thread hands the engine's step thread (``Transport.poll``)."""

from __future__ import annotations

import threading

from engine.kv_transfer import TransportEvents


class Results:
    def __init__(self):
        self._lock = threading.Lock()
        self._done: dict[str, bool] = {}
        self._released: set[str] = set()
        self._bytes, self._seconds = 0, 0.0

    def read_done(self, request_id: str, ok: bool, nbytes: int = 0, seconds: float = 0.0) -> None:
        with self._lock:
            self._done[request_id] = ok
            self._bytes += nbytes
            self._seconds += seconds

    def released(self, request_id: str) -> None:
        with self._lock:
            self._released.add(request_id)

    def take(self) -> TransportEvents:
        with self._lock:
            events = TransportEvents(self._done, frozenset(self._released), self._bytes, self._seconds)
            self._done, self._released, self._bytes, self._seconds = {}, set(), 0, 0.0
        return events
