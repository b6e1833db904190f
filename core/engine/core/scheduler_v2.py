"""Schedulers built for interface v2 run unchanged: such a scheduler applied each step's result
itself (``update``), ran the KV connector's request protocol (``update_kv_transfers``, the
``kv_connector`` of its context) and tracked its unfinished requests. This adapter gives the core
the request path of :class:`~engine.core.lifecycle.RequestLifecycle` over such a scheduler, so
the engine loop has one shape; a v3 scheduler never comes here."""

from __future__ import annotations

from engine.interfaces import EngineOutput, KVTransferReport, Request, StepPlan, StepResult


class SchedulerV2Lifecycle:
    def __init__(self, scheduler, kv_cache_manager):
        self.scheduler = scheduler
        self.kv_cache_manager = kv_cache_manager

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def schedule(self) -> StepPlan:
        return self.scheduler.schedule()  # it finished the refused requests itself

    def apply(self, plan: StepPlan, result: StepResult) -> list[EngineOutput]:
        return self.scheduler.update(plan, result)

    def abort(self, request_ids, reason: str = "abort") -> None:
        """A v2 scheduler finishes every early end as ``"abort"``; the core's output says ``reason``."""
        self.scheduler.abort(request_ids)

    def on_kv_report(self, report: KVTransferReport) -> None:
        self.scheduler.update_kv_transfers(report)

    def running(self, plan: StepPlan) -> list[Request]:
        return self.scheduler.running_requests()

    def reserve_lookahead(self, request: Request, num_tokens: int) -> bool:
        return self.kv_cache_manager.allocate_slots(request, 0, num_lookahead_tokens=num_tokens)

    def with_burst(self, plan: StepPlan, steps: int) -> StepPlan:
        """A v2 scheduler applies results itself: one decode step per pass."""
        return plan

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_pending_transfers(self) -> bool:
        pending = getattr(self.scheduler, "has_pending_transfers", None)  # defaulted in v2
        return bool(pending and pending())

    def stats(self) -> dict[str, int | float]:
        return dict(self.scheduler.stats)
