"""The KV connector's request protocol, run by the core for every scheduler.

A scheduler admits through :class:`~engine.interfaces.KVAdmission` (the prefix hit, the
allocation told to the connector, parking for an asynchronous load, resuming); the core's request
lifecycle calls the rest: each step's :class:`~engine.interfaces.KVTransferReport` (free delayed
blocks, roll back failed loads, resume parked requests), the end of each scheduled request's step
(:meth:`RequestKV.settle`) and each request's finish (:meth:`RequestKV.release`). Without a
connector the same object serves the prefix cache alone, so a scheduler has one path.
"""

from __future__ import annotations

from engine.interfaces import (
    KVAdmission,
    KVCacheManager,
    KVConnector,
    KVRequest,
    KVTransferReport,
    PrefixHit,
    Request,
    RequestStatus,
)
from engine.kv_transfer.loads import ExternalLoads
from engine.messages.kv_events import block_hashes


class RequestKV(KVAdmission):
    def __init__(self, kv_cache_manager: KVCacheManager, connector: KVConnector | None, block_size: int):
        self.kv = kv_cache_manager
        self.connector = connector
        self._loads = ExternalLoads(block_size)
        self._delayed_free: dict[str, Request] = {}
        self._rolled_back: dict[str, int] = {}  # request id -> good tokens, after this step's failed load
        self._resumed: dict[str, Request] = {}  # waiting, holding blocks an asynchronous load filled

    # -- the scheduler's side -------------------------------------------------------------
    def lookup(self, request: Request) -> PrefixHit:
        if request.request_id in self._resumed:
            return PrefixHit(num_cached=request.num_computed_tokens)
        if request.sampling_params.prompt_logprobs is not None:
            return PrefixHit()
        blocks, num_cached = self.kv.get_computed_blocks(request)
        num_external, load_async = self._external_tokens(request, num_cached)
        return PrefixHit(blocks, num_cached, num_external, load_async and bool(num_external))

    def allocate(self, request: Request, hit: PrefixHit, num_new_tokens: int) -> bool:
        resumed = self._resumed.pop(request.request_id, None)
        if not self._allocate(request, hit, hit.num_external + num_new_tokens, first=resumed is None):
            if resumed is not None:
                self._resumed[request.request_id] = resumed
            return False
        request.num_computed_tokens = hit.num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = hit.num_computed
        return True

    def park(self, request: Request, hit: PrefixHit) -> bool:
        if not self._allocate(request, hit, hit.num_external, first=True):
            return False
        request.num_cached_tokens = hit.num_computed
        request.status = RequestStatus.WAITING_FOR_KV
        return True

    def resumed(self) -> list[Request]:
        return list(self._resumed.values())

    def start_over(self, request: Request) -> None:
        del self._resumed[request.request_id]
        self.kv.free(request)
        request.num_computed_tokens = 0

    def _view(self, request: Request) -> KVRequest:
        block_hashes(request, self._loads.block_size)  # even with prefix caching off
        return KVRequest.of(request)

    def _external_tokens(self, request: Request, num_cached: int) -> tuple[int, bool]:
        """(tokens the connector loads after the local hit, whether asynchronously); never the
        last token (it is computed: it yields logits)."""
        if self.connector is None:
            return 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(self._view(request), num_cached)
        block_size = self._loads.block_size
        return min(num_external, (request.num_tokens - num_cached - 1) // block_size * block_size), load_async

    def _allocate(self, request: Request, hit: PrefixHit, num_tokens: int, first: bool) -> bool:
        """Blocks for ``num_tokens`` after the hit's cached blocks, told to the connector on a
        request's first allocation (a resumed request's load was told already)."""
        if not self.kv.allocate_slots(
            request, num_tokens, hit.computed_blocks, watermark=True, delay_cache=bool(hit.num_external)
        ):
            if self.connector is not None and first:
                self.connector.allocation_failed(self._view(request))
            return False
        if self.connector is not None and first:
            block_ids = self.kv.block_ids(request)
            self.connector.update_state_after_alloc(
                self._view(request), list(block_ids), hit.num_cached, hit.num_external
            )
            self._loads.queried(request.num_tokens - hit.num_cached)
            if hit.num_external:
                self._loads.start(request, hit.num_cached, hit.num_external, block_ids)
        return True

    # -- the core's side ------------------------------------------------------------------
    def on_report(self, report: KVTransferReport) -> None:
        """Free delayed blocks, mark requests whose synchronous load failed for rollback, resume
        parked requests whose asynchronous load ended (from the last good block)."""
        self._free_delayed(report.finished_sending)
        failed = report.failed_blocks
        for rid in self._loads.failed_requests(failed):
            if rid not in report.finished_loading:  # a synchronous load, in this step's plan
                self._rolled_back[rid] = self._loads.settle(rid, failed)[1]
        for rid in report.finished_loading:
            settled = self._loads.settle(rid, failed)
            if settled is not None:
                self._resume(*settled)

    def _resume(self, request: Request, good_tokens: int) -> None:
        if request.is_finished:  # aborted while parked: its blocks were kept until the load ended
            self._free_delayed([request.request_id])
            return
        request.num_computed_tokens = good_tokens
        request.num_cached_tokens = good_tokens
        request.status = RequestStatus.WAITING
        self._resumed[request.request_id] = request

    def settle(self, request_id: str) -> int | None:
        """A scheduled request's step is over (so is any synchronous load it had): the tokens
        it may count as computed when its load failed (what the step computed is void), else None."""
        self._loads.pop(request_id)
        return self._rolled_back.pop(request_id, None)

    def release(self, request: Request) -> dict | None:
        """The request finishes (its ``finish_reason`` set, its status not yet): free its blocks,
        now or once the connector is done with them; returns the ``kv_transfer_params`` the
        connector hands on with its last output (or None)."""
        parked_for_load = request.status is RequestStatus.WAITING_FOR_KV
        if not parked_for_load:  # a parked request's load ends in a report; any other is over
            self._loads.pop(request.request_id)
        self._resumed.pop(request.request_id, None)
        delay, handed_on = parked_for_load, None
        if self.connector is not None and not parked_for_load:
            delay, handed_on = _delay_and_params(
                self.connector.request_finished(self._view(request), list(self.kv.block_ids(request)))
            )
        if delay:
            self._delayed_free[request.request_id] = request
        else:
            self.kv.free(request)
        return handed_on

    def _free_delayed(self, request_ids) -> None:
        """Free blocks whose delayed free has ended (sent by the connector, or loaded into)."""
        for rid in request_ids:
            request = self._delayed_free.pop(rid, None)
            if request is not None:
                self.kv.free(request)

    def has_pending_transfers(self) -> bool:
        """Finished requests still hold blocks the connector delayed freeing."""
        return bool(self._delayed_free)

    @property
    def stats(self) -> dict[str, int]:
        """The external-hit counters (with a connector): queries, hits and failed loads."""
        return dict(self._loads.stats) if self.connector is not None else {}


def _delay_and_params(answer) -> tuple[bool, dict | None]:
    """``request_finished``'s answer: a bool (interface v2) or ``(delay, kv_transfer_params)`` (v3)."""
    if isinstance(answer, tuple):
        delay, params = answer
        return bool(delay), params
    return bool(answer), None
