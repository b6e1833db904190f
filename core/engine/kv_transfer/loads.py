"""The loads a KV connector makes for requests (:mod:`engine.kv_transfer.admission`): which
blocks each request is loading from outside, so that a block the worker half reports failed
maps back to its request, which then recomputes from the last good block; and the external-hit
counters.

A load is synchronous (it lands before the step's forward reads it: the request runs that step)
or asynchronous (the request is parked ``WAITING_FOR_KV`` until the worker half lists it in
``finished_loading``). Either way the loaded blocks enter the prefix cache only once the load is
known good (``allocate_slots(delay_cache=True)``), so no other request can hit a block whose load
failed.
"""

from __future__ import annotations

import attrs

from engine.messages.request import Request


@attrs.define
class ExternalLoad:
    request: Request
    num_local_tokens: int  # the prefix cache's hit before the loaded blocks
    block_ids: list[int]  # the blocks being loaded, in order
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids) * self.block_size

    def good_tokens(self, failed: frozenset[int]) -> int:
        """Tokens known good: the local hit and the loaded blocks before the first failed one."""
        good = next((i for i, b in enumerate(self.block_ids) if b in failed), len(self.block_ids))
        return self.num_local_tokens + good * self.block_size


class ExternalLoads:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._loads: dict[str, ExternalLoad] = {}
        self.stats = {"external_prefix_queries": 0, "external_prefix_hits": 0, "kv_load_failures": 0}

    def queried(self, num_tokens: int) -> None:
        """A request was admitted after asking the connector about these tokens (once per admission)."""
        self.stats["external_prefix_queries"] += num_tokens

    def start(self, request: Request, num_local: int, num_external: int, block_ids: list[int]) -> None:
        first = num_local // self.block_size
        self._loads[request.request_id] = ExternalLoad(
            request, num_local, block_ids[first : first + num_external // self.block_size], self.block_size
        )
        self.stats["external_prefix_hits"] += num_external

    def pop(self, request_id: str) -> ExternalLoad | None:
        return self._loads.pop(request_id, None)

    def settle(self, request_id: str, failed: frozenset[int]) -> tuple[Request, int] | None:
        """Forget the request's load: (the request, the tokens it may count as computed), or
        None if it had none. A failed load's lost tokens leave the external-hit count."""
        load = self._loads.pop(request_id, None)
        if load is None:
            return None
        good = load.good_tokens(failed)
        lost = load.num_local_tokens + load.num_tokens - good
        if lost:
            self.stats["kv_load_failures"] += 1
            self.stats["external_prefix_hits"] -= lost
        return load.request, good

    def failed_requests(self, failed: frozenset[int]) -> list[str]:
        """Requests with a load of one of these blocks."""
        if not failed:
            return []
        return [rid for rid, load in self._loads.items() if not failed.isdisjoint(load.block_ids)]
