"""Test plugin: a replacement scheduler written against interface v3, as small as a policy can be.

First come, first served; one token budget; running requests first, each its whole remaining
chunk (and its drafts), else it waits; waiting requests admitted while budget, sequence slots and
blocks last; when a running request cannot get blocks the latest arrival is preempted. It knows
nothing of KV connectors, grammars, stop rules or finishing: the core's request lifecycle and its
``KVAdmission`` do those, so this scheduler runs the KV connector and P/D contracts unchanged. Its
one duty to ``KVAdmission``: a head that cannot start while nothing runs makes the requests whose
asynchronous load ended (``resumed``, waiting behind it holding blocks) start over, or nothing
would ever free blocks for it.
"""

from __future__ import annotations

from engine import hookimpl
from engine.interfaces import (
    Request,
    RequestStatus,
    ScheduledRequest,
    Scheduler,
    SchedulerStats,
    StepPlan,
)


@hookimpl
def register_schedulers(register):
    register("test-fcfs", FCFSScheduler, api=3)


class FCFSScheduler(Scheduler):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.budget = ctx.config.scheduler.max_num_batched_tokens
        self.max_seqs = ctx.config.scheduler.max_num_seqs
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request_ids) -> None:
        ids = set(request_ids)
        self.waiting = [r for r in self.waiting if r.request_id not in ids]
        self.running = [r for r in self.running if r.request_id not in ids]

    def schedule(self) -> StepPlan:
        budget, scheduled, preempted = self.budget, [], []
        for request in list(self.running):
            if request in self.running and budget > 0:
                item = self._run(request, budget, preempted)
                if item is not None:
                    scheduled.append(item)
                    budget -= item.num_new_tokens + len(item.spec_token_ids)
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            item = self._admit(self.waiting[0], budget)
            if item is None:
                break
            scheduled.append(item)
            budget -= item.num_new_tokens
        return StepPlan(tuple(scheduled), tuple(preempted))

    def _run(self, request: Request, budget: int, preempted: list[str]) -> ScheduledRequest | None:
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        done = request.num_computed_tokens + num_new == request.num_tokens
        drafts = tuple(request.spec_token_ids[: budget - num_new]) if done else ()
        while not self.ctx.kv_cache_manager.allocate_slots(
            request, num_new, num_lookahead_tokens=len(drafts)
        ):
            victim = self.running.pop()
            self.ctx.kv_cache_manager.free(victim)
            victim.status, victim.num_computed_tokens = RequestStatus.PREEMPTED, 0
            self.waiting.insert(0, victim)
            self.preemptions += 1
            preempted.append(victim.request_id)
            if victim is request:
                return None
        return ScheduledRequest(request, num_new, drafts)

    def _admit(self, request: Request, budget: int) -> ScheduledRequest | None:
        """The head's first chunk, or None (the head waits: parked, or short of blocks)."""
        admission = self.ctx.kv_admission
        if request.status in (RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.WAITING_FOR_KV):
            return None
        hit = admission.lookup(request)
        if hit.loads_async:
            admission.park(request, hit)
            return None
        num_new = min(request.num_tokens - hit.num_computed, budget)
        if not admission.allocate(request, hit, num_new):
            if not self.running:  # nothing running will free blocks: those resumed loads hold go back
                for resumed in admission.resumed():
                    admission.start_over(resumed)
            return None
        self.waiting.pop(0)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return ScheduledRequest(request, num_new)

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.preemptions)
