"""Scheduler contract: random workloads (hypothesis) under a small token budget and a KV
pool small enough to force preemption, driven by a deterministic stand-in for the model
(the next token is a function of the whole sequence, as greedy decoding is). Checked:
the budget and sequence limit hold every step, blocks cover every scheduled token, every
request finishes, no block leaks, and each request's tokens equal what it would generate
alone — preemption and recompute change nothing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.plugins import load_plugins
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.step import SchedulerContext, StepResult

VOCAB = 97


def next_token(tokens: list[int]) -> int:
    return (sum(tokens[-3:]) * 31 + len(tokens) * 7) % VOCAB


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


workloads = st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 2)), min_size=1, max_size=14)


class SchedulerContract:
    scheduler_name = "default"
    kv_cache_manager_name = "default"

    def run(self, workload, num_blocks=12, block_size=4, budget=16, max_num_seqs=4, policy="fcfs",
            max_steps=3000):
        config = EngineConfig.from_kwargs(block_size=block_size, max_num_batched_tokens=budget,
                                          max_num_seqs=max_num_seqs, policy=policy)
        registry = load_plugins()
        kv = registry.get("kv_cache_managers", self.kv_cache_manager_name)(config, num_blocks)
        capacity = (num_blocks - 1) * block_size
        scheduler = registry.get("schedulers", self.scheduler_name)(SchedulerContext(config, kv, None, capacity))
        requests = []
        for i, (prompt_len, max_tokens, priority) in enumerate(workload):
            prompt = [(i * 13 + j * 5) % VOCAB for j in range(prompt_len)]
            request = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), priority=priority)
            scheduler.add_request(request)
            requests.append(request)
        preemptions = 0
        for _ in range(max_steps):
            if not scheduler.has_unfinished():
                break
            plan = scheduler.schedule()
            preemptions += len(plan.preempted)
            assert plan.num_tokens <= budget
            assert len(plan.scheduled) <= max_num_seqs
            for item in plan.scheduled:
                r = item.request
                assert item.num_new_tokens > 0
                assert len(kv.block_ids(r)) * block_size >= r.num_computed_tokens + item.num_new_tokens
            sampled = {item.request.request_id: [next_token(item.request.all_token_ids)]
                       for item in plan.scheduled if item.samples}
            scheduler.update(plan, StepResult(sampled))
        assert not scheduler.has_unfinished(), "every request must finish"
        assert kv.num_free_blocks == num_blocks - 1, "blocks leaked"
        for request, (_, max_tokens, _) in zip(requests, workload):
            assert request.finish_reason == "length"
            assert request.output_token_ids == alone(request.prompt_token_ids, max_tokens), request
        return preemptions

    @settings(max_examples=60, deadline=None)
    @given(workload=workloads, policy=st.sampled_from(["fcfs", "priority"]))
    def test_random_workloads(self, workload, policy):
        self.run(workload, policy=policy)

    def test_small_pool_forces_preemption_without_changing_outputs(self):
        workload = [(30, 12, 0), (25, 12, 0), (20, 12, 0), (35, 10, 0), (12, 12, 0)]
        assert self.run(workload, num_blocks=14, budget=16, max_num_seqs=4) > 0

    def test_priority_order_admits_urgent_first(self):
        config = EngineConfig.from_kwargs(block_size=4, max_num_batched_tokens=8, max_num_seqs=1,
                                          policy="priority")
        registry = load_plugins()
        kv = registry.get("kv_cache_managers", self.kv_cache_manager_name)(config, 32)
        scheduler = registry.get("schedulers", self.scheduler_name)(SchedulerContext(config, kv, None, 120))
        scheduler.add_request(Request("later", [1, 2, 3], SamplingParams(max_tokens=1), priority=5))
        scheduler.add_request(Request("urgent", [1, 2, 3], SamplingParams(max_tokens=1), priority=0))
        assert [s.request.request_id for s in scheduler.schedule().scheduled] == ["urgent"]

    def test_abort_frees_blocks(self):
        config = EngineConfig.from_kwargs(block_size=4)
        registry = load_plugins()
        kv = registry.get("kv_cache_managers", self.kv_cache_manager_name)(config, 16)
        scheduler = registry.get("schedulers", self.scheduler_name)(SchedulerContext(config, kv, None, 60))
        request = Request("x", list(range(10)), SamplingParams(max_tokens=5))
        scheduler.add_request(request)
        scheduler.schedule()
        assert kv.num_free_blocks < 15
        scheduler.abort(["x"])
        assert request.finish_reason == "abort" and kv.num_free_blocks == 15
        assert not scheduler.has_unfinished()
