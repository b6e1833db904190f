"""The stored responses of ``/v1/responses`` (``store: true``, the default): what
``previous_response_id`` continues and ``GET /v1/responses/{id}`` returns. In memory only,
bounded by ``--responses-store-size`` (the oldest goes first) and ``--responses-store-ttl``
(seconds since it was stored), so a server that answers forever never grows without end.
Written from the event loop and from worker threads, hence the lock."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import attrs

from engine_server.errors import APIError

DEFAULT_SIZE = 1000  # responses kept
DEFAULT_TTL = 3600.0  # seconds one is kept


@attrs.frozen
class StoredResponse:
    response: dict  # the response object as it was answered
    input_items: list[dict]  # this request's own input items, with ids
    history: list[dict]  # every item before the output: earlier turns' inputs and outputs, then input_items


def not_found(response_id: str, param: str | None = None) -> APIError:
    """OpenAI's answer for an id it does not hold (never stored, deleted or expired)."""
    return APIError(404, f"Response with id '{response_id[:200]}' not found.", param, "response_not_found")


class ResponseStore:
    def __init__(self, size: int = DEFAULT_SIZE, ttl: float = DEFAULT_TTL, clock=time.monotonic):
        self.size, self.ttl, self.clock = size, ttl, clock
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, entry: StoredResponse) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._entries[entry.response["id"]] = (self.clock(), entry)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The entry, or a 404 (``param`` names the field that gave the id)."""
        with self._lock:
            self._expire()
            found = self._entries.get(response_id)
        if found is None:
            raise not_found(response_id, param)
        return found[1]

    def delete(self, response_id: str) -> None:
        with self._lock:
            self._expire()
            if self._entries.pop(response_id, None) is None:
                raise not_found(response_id)

    def _expire(self) -> None:
        """Drop the entries past their TTL: the oldest are first, so stop at the first fresh one."""
        deadline = self.clock() - self.ttl
        while self._entries:
            stored_at, _ = next(iter(self._entries.values()))
            if stored_at > deadline:
                break
            self._entries.popitem(last=False)
