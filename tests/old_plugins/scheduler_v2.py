"""A scheduler plugin as an author wrote it for scheduler interface v2, kept frozen: it applies
each step's result itself (appends tokens, stop rules, finishing and freeing), tracks its
unfinished requests and answers ``update_kv_transfers``. Today's core runs it unchanged through
its v2 adapter (``engine.core.scheduler_v2``)."""

from __future__ import annotations

from engine import hookimpl
from engine.interfaces import EngineOutput, RequestStatus, ScheduledRequest, Scheduler, StepPlan


@hookimpl
def register_schedulers(register):
    register("old-fcfs", FCFSSchedulerV2, api=2)


class FCFSSchedulerV2(Scheduler):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.kv = ctx.kv_cache_manager
        self.budget = ctx.config.scheduler.max_num_batched_tokens
        self.waiting, self.running, self.requests = [], [], {}

    def add_request(self, request):
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_ids):
        for rid in request_ids:
            if rid in self.requests:
                self._finish(self.requests[rid], "abort")

    def schedule(self):
        budget, scheduled = self.budget, []
        for request in self.running:
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new and self.kv.allocate_slots(request, num_new):
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
        while self.waiting and budget > 0 and self.waiting[0].status is RequestStatus.WAITING:
            request = self.waiting[0]
            num_new = min(request.num_tokens, budget)
            if not self.kv.allocate_slots(request, num_new):
                break
            self.running.append(self.waiting.pop(0))
            request.status = RequestStatus.RUNNING
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return StepPlan(tuple(scheduled))

    def update(self, plan, result):
        outputs = []
        for item in plan.scheduled:
            request = item.request
            if request.is_finished:
                continue
            request.num_computed_tokens += item.num_new_tokens
            tokens = result.sampled.get(request.request_id)
            if tokens is None:
                continue
            request.append_output(tokens[0])
            params = request.sampling_params
            reason = "stop" if tokens[0] == request.eos_token_id and not params.ignore_eos else None
            if len(request.output_token_ids) >= params.max_tokens:
                reason = reason or "length"
            if reason:
                self._finish(request, reason)
            outputs.append(EngineOutput(request.request_id, tokens[:1], finish_reason=reason))
        return outputs

    def _finish(self, request, reason):
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        del self.requests[request.request_id]
        self.kv.free(request)

    def update_kv_transfers(self, report):
        pass  # it never takes a KV connector

    def has_unfinished(self):
        return bool(self.requests)

    def running_requests(self):
        return list(self.running)

    @property
    def stats(self):
        return {"running": len(self.running), "waiting": len(self.waiting), "preemptions": 0}
