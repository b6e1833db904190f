"""Scheduler contract: random workloads (hypothesis) under a small token budget and a KV
pool small enough to force preemption, driven by a deterministic stand-in for the model
(the next token is a function of the whole sequence, as greedy decoding is) and the core's
request lifecycle (:func:`engine.core.lifecycle.request_path`, which applies each step's
result), so only the scheduler's policy is under test. Checked: the budget and sequence limit
hold every step, blocks cover every scheduled token, every request finishes, no block leaks,
and each request's tokens equal what it would generate alone — preemption and recompute change
nothing."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.core.lifecycle import request_path
from engine.messages.request import Request
from engine.messages.sampling_params import SamplingParams
from engine.messages.step import StepResult
from engine.plugins import load_plugins

VOCAB = 97


def next_token(tokens: list[int]) -> int:
    return (sum(tokens[-3:]) * 31 + len(tokens) * 7) % VOCAB


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


workloads = st.lists(
    st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 2)), min_size=1, max_size=14
)


class SchedulerContract:
    scheduler_name = "default"
    kv_cache_manager_name = "default"
    policies = ("fcfs", "priority")  # the ``policy`` values the scheduler implements

    def request_path(self, num_blocks: int, **options):
        """(the scheduler's request path, its KV cache manager) over a pool of ``num_blocks``."""
        config = EngineConfig.from_kwargs(
            scheduler=self.scheduler_name, kv_cache_manager=self.kv_cache_manager_name, **options
        )
        registry = load_plugins()
        kv = registry.get("kv_cache_managers", self.kv_cache_manager_name)(config, num_blocks)
        capacity = (num_blocks - 1) * config.cache.block_size
        return request_path(registry, config, kv, None, capacity), kv

    def run(
        self, workload, num_blocks=12, block_size=4, budget=16, max_num_seqs=4, policy="fcfs", max_steps=3000
    ):
        path, kv = self.request_path(
            num_blocks,
            block_size=block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            policy=policy,
        )
        requests = []
        for i, (prompt_len, max_tokens, priority) in enumerate(workload):
            prompt = [(i * 13 + j * 5) % VOCAB for j in range(prompt_len)]
            request = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), priority=priority)
            path.add(request)
            requests.append(request)
        preemptions = 0
        for _ in range(max_steps):
            if not path.has_unfinished():
                break
            plan = path.schedule()
            preemptions += len(plan.preempted)
            assert plan.num_tokens <= budget
            assert len(plan.scheduled) <= max_num_seqs
            for item in plan.scheduled:
                r = item.request
                assert item.num_new_tokens > 0
                assert len(kv.block_ids(r)) * block_size >= r.num_computed_tokens + item.num_new_tokens
            sampled = {
                item.request.request_id: [next_token(item.request.all_token_ids)]
                for item in plan.scheduled
                if item.samples
            }
            path.apply(plan, StepResult(sampled))
        assert not path.has_unfinished(), "every request must finish"
        assert kv.num_free_blocks == num_blocks - 1, "blocks leaked"
        for request, (_, max_tokens, _) in zip(requests, workload):
            assert request.finish_reason == "length"
            assert request.output_token_ids == alone(request.prompt_token_ids, max_tokens), request
        return preemptions

    # one contract class per scheduler (a plugin's, the built-in's) runs this same method
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.differing_executors])
    @given(workload=workloads, choice=st.integers(0, 1))
    def test_random_workloads(self, workload, choice):
        self.run(workload, policy=self.policies[choice % len(self.policies)])

    def test_small_pool_forces_preemption_without_changing_outputs(self):
        workload = [(30, 12, 0), (25, 12, 0), (20, 12, 0), (35, 10, 0), (12, 12, 0)]
        assert self.run(workload, num_blocks=14, budget=16, max_num_seqs=4) > 0

    def test_policy_order_admits_first_who_comes_first(self):
        """With one sequence slot, the request the policy orders first runs: the urgent one under
        ``priority``, the first arrival under ``fcfs``."""
        for policy in self.policies:
            path, _ = self.request_path(
                32, block_size=4, max_num_batched_tokens=8, max_num_seqs=1, policy=policy
            )
            path.add(Request("later", [1, 2, 3], SamplingParams(max_tokens=1), priority=5))
            path.add(Request("urgent", [1, 2, 3], SamplingParams(max_tokens=1), priority=0))
            first = "urgent" if policy == "priority" else "later"
            assert [s.request.request_id for s in path.schedule().scheduled] == [first], policy

    def test_abort_frees_blocks(self):
        path, kv = self.request_path(16, block_size=4)
        request = Request("x", list(range(10)), SamplingParams(max_tokens=5))
        path.add(request)
        path.schedule()
        assert kv.num_free_blocks < 15
        path.abort(["x"])
        assert request.finish_reason == "abort" and kv.num_free_blocks == 15
        assert not path.has_unfinished()
        assert not path.schedule().scheduled, "an aborted request must leave the queues"
