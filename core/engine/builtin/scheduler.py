"""Default scheduler: continuous batching under one token budget shared by prefill and
decode, chunked prefill, preemption by recompute, FCFS or priority order.

Each step serves running requests first (decodes and unfinished prefill chunks), then
admits waiting ones while budget, sequence slots and blocks last. While a running request
is decoding, prefill chunks together get only the step's prefill share
(:mod:`engine.builtin.chunking`), sized so that such a step takes about
``shared_step_target_s``: a long prompt never stalls the streams for a whole chunk. When a
running request cannot get blocks, the lowest-priority, latest-arrived running request not yet
scheduled this step is preempted (its blocks freed; it resumes from whatever prefix is
still cached; the core drops its drafts). No new request is admitted in a step that preempted.

Admission control: with ``max_queued_requests`` a request arriving while that many wait
is refused (``Overloaded``); with ``max_queue_wait`` one still unscheduled that long after
it arrived is dropped and listed in ``StepPlan.refused`` (the core finishes it). A request that ran
once (preempted since) or waits for its grammar to compile is never refused.

Images: a step encodes at most ``max_num_encoder_input_tokens`` image tokens
(:mod:`engine.builtin.encoder_budget`): a chunk stops before an image that no longer fits.

LoRA: with ``enable_lora`` a step holds at most ``max_loras`` distinct adapters. Running
requests' adapters are the ones a step may use; a waiting request of another adapter is passed
over, keeping its place, while requests that fit are admitted behind it.

Prefix hits and KV connector loads come through the context's
:class:`~engine.interfaces.KVAdmission`: a request whose prefix loads asynchronously is parked
(``WAITING_FOR_KV``) holding its blocks, skipped like one waiting for its grammar, and admitted
again, ahead of the queue, once the load ended. The core applies each step's result and finishes
requests (:mod:`engine.core.lifecycle`); this module is policy only.
"""

from __future__ import annotations

import bisect
import collections
import time

from engine.builtin.chunking import PrefillShare
from engine.builtin.encoder_budget import EncoderBudget
from engine.interfaces import (
    Overloaded,
    Request,
    RequestStatus,
    ScheduledRequest,
    Scheduler,
    SchedulerContext,
    SchedulerStats,
    StepPlan,
)

PARKED = (RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.WAITING_FOR_KV)


class DefaultScheduler(Scheduler):
    serves_lora = True

    def __init__(self, ctx: SchedulerContext):
        super().__init__(ctx)
        self.cfg = ctx.config.scheduler
        self.kv = ctx.kv_cache_manager
        self.admission = ctx.kv_admission
        self.max_model_len = ctx.max_model_len
        self.waiting: list[Request] = []  # sorted by _order
        self.running: list[Request] = []
        self._preemptions = 0
        self._deadlines: collections.deque[tuple[float, Request]] = collections.deque()  # arrival order
        self._rejected = {"rejected_queue_full": 0, "rejected_queue_wait": 0}
        self._share = PrefillShare(self.cfg.shared_step_target_s, self.cfg.max_num_batched_tokens)
        self._encoder = EncoderBudget(
            self.cfg.max_num_encoder_input_tokens or self.cfg.max_num_batched_tokens
        )
        lora = ctx.config.lora
        self.max_loras = lora.max_loras if lora.enable_lora else None

    def _order(self, request: Request) -> tuple[int, int]:
        priority = request.priority if self.cfg.policy == "priority" else 0
        return (priority, request.arrival)

    def add_request(self, request: Request) -> None:
        cap = self.cfg.max_queued_requests
        if cap and len(self.waiting) >= cap:
            self._rejected["rejected_queue_full"] += 1
            raise Overloaded(
                f"overloaded: {len(self.waiting)} requests are queued already "
                f"(max_queued_requests={cap}); retry later"
            )
        bisect.insort(self.waiting, request, key=self._order)
        if self.cfg.max_queue_wait:
            self._deadlines.append((time.monotonic() + self.cfg.max_queue_wait, request))

    def _refuse_overdue(self) -> tuple[str, ...]:
        """Drop the requests still unscheduled ``max_queue_wait`` after they arrived."""
        refused, now = [], time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request = self._deadlines.popleft()
            if request.status is RequestStatus.WAITING:  # never admitted; not parked, not finished
                self.waiting.remove(request)
                refused.append(request.request_id)
        self._rejected["rejected_queue_wait"] += len(refused)
        return tuple(refused)

    def abort(self, request_ids) -> None:
        ids = set(request_ids)
        for request_id in ids:
            self._encoder.forget(request_id)
        self.running = [r for r in self.running if r.request_id not in ids]
        self.waiting = [r for r in self.waiting if r.request_id not in ids]

    def schedule(self) -> StepPlan:
        refused = self._refuse_overdue() if self._deadlines else ()
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._share.begin(any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running))
        self._encoder.begin()
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
        charge = self._encoder.fit(request, request.num_computed_tokens, num_new)
        num_new = charge.num_new
        if not num_new:  # the step's prefill share or encoder budget is spent
            return None
        drafts: list[int] = []
        if request.num_computed_tokens + num_new == request.num_tokens:
            room = min(budget - num_new, self.max_model_len - request.num_tokens)
            drafts = request.spec_token_ids[: max(0, room)]
        while not self.kv.allocate_slots(request, num_new, num_lookahead_tokens=len(drafts)):
            # only when the cache is full: built every call, this set made a step's scheduling
            # quadratic in the running requests (2 ms of 256)
            taken = {s.request.request_id for s in scheduled}
            victim = max((r for r in self.running if r.request_id not in taken), key=self._order)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return None
        self._encoder.charge(request, charge)
        return ScheduledRequest(request, num_new, tuple(drafts))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self._encoder.forget(request.request_id)
        request.num_preemptions += 1
        self._preemptions += 1
        bisect.insort(self.waiting, request, key=self._order)

    def _admit_waiting(self, budget: int) -> list[ScheduledRequest]:
        resumed = {r.request_id: r for r in self.admission.resumed()}
        admitted = self._admit_resumed(sorted(resumed.values(), key=self._order), budget) if resumed else []
        budget -= sum(item.num_new_tokens for item in admitted)
        parked = []
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            request = self.waiting.pop(0)
            if request.status in PARKED or request.request_id in resumed or not self._adapter_fits(request):
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

    def _admit_resumed(self, resumed: list[Request], budget: int) -> list[ScheduledRequest]:
        """Requests whose asynchronous load ended go first: they hold blocks, and behind a head
        that cannot get blocks they would hold them forever. One that cannot continue while
        nothing runs (nothing will free blocks for it) gives its blocks back and starts over."""
        admitted = []
        for request in resumed:
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            if not self._adapter_fits(request):
                continue
            item = self._admit(request, budget)
            if item is None:
                if not self.running:
                    self.admission.start_over(request)
                continue
            self.waiting.remove(request)
            admitted.append(item)
            budget -= item.num_new_tokens
        return admitted

    def _adapter_fits(self, request: Request) -> bool:
        """Whether ``request`` may run beside the running requests: it uses no adapter, or one
        of theirs, or they use fewer than ``max_loras``."""
        if request.lora_id is None or self.max_loras is None:
            return True
        active = {r.lora_id for r in self.running} - {None}
        return request.lora_id in active or len(active) < self.max_loras

    def _admit(self, request: Request, budget: int) -> ScheduledRequest | Request | None:
        """The request's first chunk, or the request itself when it parked for an asynchronous
        load, or None when it cannot start this step."""
        hit = self.admission.lookup(request)
        if hit.loads_async:
            return request if self.admission.park(request, hit) else None
        remaining = request.num_tokens - hit.num_computed
        if not self.cfg.enable_chunked_prefill and remaining > budget:
            return None
        charge = self._encoder.fit(request, hit.num_computed, self._chunk(remaining, budget))
        if not self.cfg.enable_chunked_prefill and charge.num_new < remaining:
            return None  # its images do not fit this step's encoder budget
        num_new = charge.num_new
        if not num_new or not self.admission.allocate(request, hit, num_new):
            return None
        self._encoder.charge(request, charge)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return ScheduledRequest(request, num_new)

    def step_done(self, plan: StepPlan) -> None:
        self._share.end()

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self._preemptions, **self._rejected)
