"""Default scheduler: continuous batching under one token budget shared by prefill and
decode, chunked prefill, preemption by recompute, FCFS or priority order.

Each step serves running requests first (decodes and unfinished prefill chunks), then
admits waiting ones while budget, sequence slots and blocks last. While a running request
is decoding, prefill chunks together get only the step's prefill share
(:mod:`engine.builtin.chunking`), sized so that such a step takes about
``shared_step_target_s``: a long prompt never stalls the streams for a whole chunk. When a
running request cannot get blocks, the lowest-priority, latest-arrived running request not yet
scheduled this step is preempted (its blocks freed; it resumes from whatever prefix is
still cached). No new request is admitted in a step that preempted.

Admission control: with ``max_queued_requests`` a request arriving while that many wait
is refused (``Overloaded``); with ``max_queue_wait`` one still unscheduled that long after
it arrived is finished unscheduled and listed in ``StepPlan.refused``. A request that ran
once (preempted since) or waits for its grammar to compile is never refused.

With a KV connector (:mod:`engine.builtin.kv_loads`), a request admitted with an asynchronous load
is parked (``WAITING_FOR_KV``) holding its blocks, skipped like one waiting for its grammar, and
admitted again, ahead of the queue, once the worker half reports the load; a load that failed rolls
the request back to the last good block, to be recomputed.
"""

from __future__ import annotations

import bisect
import collections
import time

from engine.builtin.chunking import PrefillShare
from engine.builtin.kv_cache_manager import block_hashes
from engine.builtin.kv_loads import ExternalLoads
from engine.interfaces import KVRequest, KVTransferReport, Scheduler
from engine.request import Request, RequestStatus
from engine.step import EngineOutput, Overloaded, ScheduledRequest, StepPlan, StepResult

PARKED = (RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.WAITING_FOR_KV)


class DefaultScheduler(Scheduler):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.cfg = ctx.config.scheduler
        self.kv = ctx.kv_cache_manager
        self.connector = ctx.kv_connector
        self.max_model_len = ctx.max_model_len
        self.waiting: list[Request] = []  # sorted by _order
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._delayed_free: dict[str, Request] = {}
        self._preemptions = 0
        self._deadlines: collections.deque[tuple[float, Request]] = collections.deque()  # arrival order
        self._rejected = {"rejected_queue_full": 0, "rejected_queue_wait": 0}
        self._share = PrefillShare(self.cfg.shared_step_target_s, self.cfg.max_num_batched_tokens)
        self._loads = ExternalLoads(ctx.config.cache.block_size)
        self._rolled_back: dict[str, int] = {}  # request id -> good tokens, after this step's failed load
        self._resumed: dict[str, Request] = {}  # waiting, holding blocks an asynchronous load filled

    def _order(self, request: Request) -> tuple[int, int]:
        priority = request.priority if self.cfg.policy == "priority" else 0
        return (priority, request.arrival)

    def add_request(self, request: Request) -> None:
        cap = self.cfg.max_queued_requests
        if cap and len(self.waiting) >= cap:
            self._rejected["rejected_queue_full"] += 1
            raise Overloaded(f"overloaded: {len(self.waiting)} requests are queued already "
                             f"(max_queued_requests={cap}); retry later")
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=self._order)
        if self.cfg.max_queue_wait:
            self._deadlines.append((time.monotonic() + self.cfg.max_queue_wait, request))

    def _refuse_overdue(self) -> tuple[str, ...]:
        """Finish the requests still unscheduled ``max_queue_wait`` after they arrived."""
        refused, now = [], time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request = self._deadlines.popleft()
            if request.status is RequestStatus.WAITING:  # never admitted; not parked, not finished
                self._finish(request, "error")
                refused.append(request.request_id)
        self._rejected["rejected_queue_wait"] += len(refused)
        return tuple(refused)

    def abort(self, request_ids) -> None:
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                self._finish(request, "abort")

    def schedule(self) -> StepPlan:
        refused = self._refuse_overdue() if self._deadlines else ()
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._share.begin(any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running))
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier this step
                continue
            item = self._schedule_running(request, budget, scheduled, preempted)
            if item is not None:
                scheduled.append(item)
                budget -= item.num_new_tokens + len(item.spec_token_ids)
        if not preempted:
            scheduled.extend(self._admit_waiting(budget))
        return StepPlan(tuple(scheduled), tuple(preempted), refused)

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens to compute this step out of ``remaining`` (chunked prefill); a prefill
        chunk also within what is left of the step's prefill share (0: none this step)."""
        num_new = min(remaining, budget)
        if self.cfg.long_prefill_token_threshold:
            num_new = min(num_new, self.cfg.long_prefill_token_threshold)
        if remaining > 1 and self.cfg.enable_chunked_prefill:
            num_new = self._share.take(num_new)
        return num_new

    def _schedule_running(self, request, budget, scheduled, preempted) -> ScheduledRequest | None:
        num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
        if not num_new:  # the step's prefill share is spent
            return None
        drafts: list[int] = []
        if request.num_computed_tokens + num_new == request.num_tokens:
            room = min(budget - num_new, self.max_model_len - request.num_tokens)
            drafts = request.spec_token_ids[:max(0, room)]
        taken = {s.request.request_id for s in scheduled}
        while not self.kv.allocate_slots(request, num_new, num_lookahead_tokens=len(drafts)):
            victim = max((r for r in self.running if r.request_id not in taken), key=self._order)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return None
        return ScheduledRequest(request, num_new, tuple(drafts))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_probs = [], None
        request.num_preemptions += 1
        self._preemptions += 1
        bisect.insort(self.waiting, request, key=self._order)

    def _admit_waiting(self, budget: int) -> list[ScheduledRequest]:
        admitted = self._admit_resumed(budget) if self._resumed else []
        budget -= sum(item.num_new_tokens for item in admitted)
        parked = []
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            request = self.waiting.pop(0)
            if request.status in PARKED or request.request_id in self._resumed:
                parked.append(request)
                continue
            item = self._admit(request, budget)
            if item is request:  # its prefix loads asynchronously: parked
                parked.append(request)
                continue
            if item is None:
                self.waiting.insert(0, request)
                break
            admitted.append(item)
            budget -= item.num_new_tokens
        for request in parked:
            bisect.insort(self.waiting, request, key=self._order)
        return admitted

    def _admit_resumed(self, budget: int) -> list[ScheduledRequest]:
        """Requests whose asynchronous load ended go first: they hold blocks, and behind a head
        that cannot get blocks they would hold them forever. One that cannot continue while
        nothing runs (nothing will free blocks for it) gives its blocks back and starts over."""
        admitted = []
        for request in sorted(self._resumed.values(), key=self._order):
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            item = self._admit(request, budget)
            if item is None:
                if not self.running:
                    self._start_over(request)
                continue
            del self._resumed[request.request_id]
            self.waiting.remove(request)
            admitted.append(item)
            budget -= item.num_new_tokens
        return admitted

    def _start_over(self, request: Request) -> None:
        del self._resumed[request.request_id]
        self.kv.free(request)
        request.num_computed_tokens = 0

    def _admit(self, request: Request, budget: int) -> ScheduledRequest | Request | None:
        """The request's first chunk, or the request itself when it parked for an asynchronous
        load, or None when it cannot start this step."""
        resumed = bool(self.kv.block_ids(request))  # an asynchronous load into its blocks has ended
        if resumed:
            computed_blocks, num_cached, num_external, load_async = [], request.num_computed_tokens, 0, False
        else:
            # prompt log-probs need logits at every prompt position: reuse no cached prefix
            reuse = request.sampling_params.prompt_logprobs is None
            computed_blocks, num_cached = self.kv.get_computed_blocks(request) if reuse else ([], 0)
            num_external, load_async = self._external_tokens(request, num_cached) if reuse else (0, False)
        if load_async and num_external:
            return self._park_for_load(request, computed_blocks, num_cached, num_external)
        remaining = request.num_tokens - num_cached - num_external
        if not self.cfg.enable_chunked_prefill and remaining > budget:
            return None
        num_new = self._chunk(remaining, budget)
        if not num_new:
            return None
        if not self._allocate_for_admission(request, num_new + num_external, computed_blocks, num_cached,
                                            num_external, first=not resumed):
            return None
        request.num_computed_tokens = num_cached + num_external
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached + num_external
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return ScheduledRequest(request, num_new)

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

    def _allocate_for_admission(self, request: Request, num_tokens: int, computed_blocks, num_cached: int,
                                num_external: int, first: bool = True) -> bool:
        """Blocks for the request's first chunk (and what the connector loads), told to the connector."""
        if not self.kv.allocate_slots(request, num_tokens, computed_blocks, watermark=True,
                                      delay_cache=bool(num_external)):
            if self.connector is not None and first:
                self.connector.allocation_failed(self._view(request))
            return False
        if self.connector is not None and first:
            block_ids = self.kv.block_ids(request)
            self.connector.update_state_after_alloc(self._view(request), list(block_ids), num_cached, num_external)
            self._loads.queried(request.num_tokens - num_cached)
            if num_external:
                self._loads.start(request, num_cached, num_external, block_ids)
        return True

    def _park_for_load(self, request: Request, computed_blocks, num_cached: int,
                       num_external: int) -> Request | None:
        if not self._allocate_for_admission(request, num_external, computed_blocks, num_cached, num_external):
            return None
        request.num_cached_tokens = num_cached + num_external
        request.status = RequestStatus.WAITING_FOR_KV
        return request

    def update_kv_transfers(self, report: KVTransferReport) -> None:
        """Free delayed blocks, roll back requests whose load failed, resume parked requests."""
        self._free_delayed(report.finished_sending)
        failed = report.failed_blocks
        for rid in self._loads.failed_requests(failed):
            if rid not in report.finished_loading:  # a synchronous load, in this step's plan
                self._rolled_back[rid] = self._loads.settle(rid, failed)[1]
        for rid in report.finished_loading:
            settled = self._loads.settle(rid, failed)
            if settled is not None:
                self._resume_after_load(*settled)

    def _resume_after_load(self, request: Request, good_tokens: int) -> None:
        if request.is_finished:  # aborted while parked: its blocks were kept until the load ended
            self._free_delayed([request.request_id])
            return
        request.num_computed_tokens = good_tokens
        request.num_cached_tokens = good_tokens
        request.status = RequestStatus.WAITING
        self._resumed[request.request_id] = request

    def update(self, plan: StepPlan, result: StepResult) -> list[EngineOutput]:
        self._share.end()
        outputs = []
        for item in plan.scheduled:
            request = item.request
            rid = request.request_id
            self._loads.pop(rid)  # a synchronous load of this step is over
            good = self._rolled_back.pop(rid, None)
            if request.is_finished:  # aborted while the step ran
                continue
            if good is not None:  # its load failed: what the step computed after the good blocks is void
                request.num_computed_tokens = good
                request.num_cached_tokens = min(request.num_cached_tokens, good)
                continue
            request.num_computed_tokens += item.num_new_tokens
            if rid in result.pooled:
                outputs.append(EngineOutput(rid, [], finish_reason="stop", pooled=result.pooled[rid]))
                self._finish(request, "stop")
                continue
            prompt_logprobs = result.prompt_logprobs.get(rid)
            tokens = result.sampled.get(rid)
            if tokens is None:
                if prompt_logprobs:
                    outputs.append(EngineOutput(rid, [], new_prompt_logprobs=prompt_logprobs))
                continue
            request.num_computed_tokens += len(tokens) - 1  # accepted drafts were computed
            request.spec_token_ids, request.spec_probs = [], None
            accepted, reason = [], None
            for token in tokens:
                request.append_output(token)
                if request.grammar is not None:
                    request.grammar.accept_tokens([token])
                accepted.append(token)
                reason = self._stop_reason(request, token)
                if reason:
                    break
            logprobs = result.logprobs.get(rid)
            handed_on = self._finish(request, reason) if reason else None
            outputs.append(EngineOutput(
                rid, accepted, logprobs[:len(accepted)] if logprobs else None, prompt_logprobs,
                finish_reason=reason, stop_reason=request.stop_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0), num_draft_tokens=request.num_draft_tokens,
                num_accepted_tokens=request.num_accepted_tokens, kv_transfer_params=handed_on))
        return outputs

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return "stop"
            if token in params.stop_token_ids:
                request.stop_reason = token
                return "stop"
            if request.grammar is not None and request.grammar.is_terminated():
                return "stop"
        if (params.max_tokens is not None and num_output >= params.max_tokens) \
                or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, request: Request, reason: str) -> dict | None:
        """Finish the request and free its blocks, unless the connector delays that; returns the
        ``kv_transfer_params`` the connector hands on with its last output (or None)."""
        parked_for_load = request.status is RequestStatus.WAITING_FOR_KV
        if not parked_for_load:  # a parked request's load ends in a report; any other is over
            self._loads.pop(request.request_id)
        self._resumed.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.requests.pop(request.request_id, None)
        delay, handed_on = parked_for_load, None
        if self.connector is not None and not parked_for_load:
            delay, handed_on = _delay_and_params(self.connector.request_finished(
                self._view(request), list(self.kv.block_ids(request))))
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

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_pending_transfers(self) -> bool:
        return bool(self._delayed_free)

    def running_requests(self) -> list[Request]:
        return list(self.running)

    @property
    def stats(self) -> dict[str, int | float]:
        return {"running": len(self.running), "waiting": len(self.waiting),
                "preemptions": self._preemptions, "kv_cache_usage": self.kv.usage, **self.kv.stats,
                **self._rejected, **(self._loads.stats if self.connector is not None else {})}


def _delay_and_params(answer) -> tuple[bool, dict | None]:
    """``request_finished``'s answer: a bool (interface v2) or ``(delay, kv_transfer_params)`` (v3)."""
    if isinstance(answer, tuple):
        delay, params = answer
        return bool(delay), params
    return bool(answer), None
