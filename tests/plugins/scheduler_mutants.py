"""Planted bugs: the built-in scheduler with one mistake each, the mistakes scheduler authors
make. Not registered by the suite's conftest: ``tests/test_scheduler_kit_mutations.py`` registers
them in a child pytest that runs the scheduler kit on each, and checks that it fails."""

from __future__ import annotations

import bisect

from engine import hookimpl
from engine.builtin.scheduler import PARKED, DefaultScheduler
from engine.interfaces import RequestStatus, StepPlan


class Charging(DefaultScheduler):
    """The built-in ``schedule`` with what a running request's item costs the budget split out."""

    def schedule(self) -> StepPlan:
        refused = self._refuse_overdue() if self._deadlines else ()
        budget = self.cfg.max_num_batched_tokens
        scheduled, preempted = [], []
        self._share.begin(any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running))
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue
            item = self._schedule_running(request, budget, scheduled, preempted)
            if item is not None:
                scheduled.append(item)
                budget -= self.cost(item)
        if not preempted:
            scheduled.extend(self._admit_waiting(budget))
        return StepPlan(tuple(scheduled), tuple(preempted), refused)


class DecodesOffBudget(Charging):
    """Charges the token budget for prefill chunks only: a decode is one token, surely free."""

    def cost(self, item) -> int:
        return item.num_new_tokens + len(item.spec_token_ids) if item.num_new_tokens > 1 else 0


class DraftsOffBudget(Charging):
    """Charges a running request the tokens it computes, as admission does, not its drafts too."""

    def cost(self, item) -> int:
        return item.num_new_tokens


class OneSeqTooMany(DefaultScheduler):
    """Admits while ``len(running) <= max_num_seqs``: one request more than the limit runs."""

    def _admit_waiting(self, budget):
        resumed = {r.request_id: r for r in self.admission.resumed()}
        admitted = self._admit_resumed(sorted(resumed.values(), key=self._order), budget) if resumed else []
        budget -= sum(item.num_new_tokens for item in admitted)
        parked = []
        while self.waiting and budget > 0 and len(self.running) <= self.cfg.max_num_seqs:
            request = self.waiting.pop(0)
            if request.status in PARKED or request.request_id in resumed:
                parked.append(request)
                continue
            item = self._admit(request, budget)
            if item is request:
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


class DropsPreempted(DefaultScheduler):
    """Frees a preempted request's blocks and forgets to queue it again: it never finishes."""

    def _preempt(self, request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self._preemptions += 1


class PreemptKeepsCount(DefaultScheduler):
    """Preempts without setting ``num_computed_tokens`` back to 0: the freed blocks' tokens still
    count as computed, and the manager sizes and caches the next allocation from them."""

    def _preempt(self, request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        self._preemptions += 1
        bisect.insort(self.waiting, request, key=self._order)


class AbortForgetsWaiting(DefaultScheduler):
    """Drops aborted requests from ``running`` only, since a request finishes while it runs."""

    def abort(self, request_ids) -> None:
        ids = set(request_ids)
        self.running = [r for r in self.running if r.request_id not in ids]


class LoRAUnlimited(DefaultScheduler):
    """Says it serves LoRA but admits every adapter: more than ``max_loras`` in a step."""

    def _adapter_fits(self, request):
        return True


class LoRABlocksTheQueue(DefaultScheduler):
    """Treats a request whose adapter does not fit like one that cannot get blocks: admission
    stops there, and the requests behind it wait for nothing."""

    def _adapter_fits(self, request):
        return True

    def _admit(self, request, budget):
        active = {r.lora_id for r in self.running} - {None}
        if request.lora_id is not None and request.lora_id not in active and len(active) >= self.max_loras:
            return None
        return super()._admit(request, budget)


MUTANTS = {
    "decodes-off-budget": DecodesOffBudget,
    "drafts-off-budget": DraftsOffBudget,
    "one-seq-too-many": OneSeqTooMany,
    "drops-preempted": DropsPreempted,
    "preempt-keeps-count": PreemptKeepsCount,
    "abort-forgets-waiting": AbortForgetsWaiting,
    "lora-unlimited": LoRAUnlimited,
    "lora-blocks-the-queue": LoRABlocksTheQueue,
}


@hookimpl
def register_schedulers(register):
    for name, scheduler in MUTANTS.items():
        register(name, scheduler, api=3)
