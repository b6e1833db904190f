"""Scheduler contract: random workloads (hypothesis) under a small token budget and a KV
pool small enough to force preemption, driven by a deterministic stand-in for the model
(the next token is a function of the whole sequence, as greedy decoding is) and the core's
request lifecycle (:func:`engine.core.lifecycle.request_path`, which applies each step's
result), so only the scheduler's policy is under test. With ``drafts`` a stand-in drafter
proposes (its slots reserved as the core's speculator reserves them), right for a while and then
wrong, and the stand-in model verifies the drafts greedily. Checked: the budget and sequence
limit hold every step, slots cover every scheduled token and draft, a preempted request starts
over (no blocks, nothing computed), every request finishes, no block leaks, and each request's
tokens equal what it would generate alone: preemption, recompute and drafts change nothing.
Beside the random workloads, one small test per bug scheduler authors make: decode or draft
tokens left out of the budget, one request too many admitted, a preempted request dropped or
resumed from its stale count, an aborted waiting request left queued; and for a scheduler that
serves LoRA (``Scheduler.serves_lora``), more than ``max_loras`` adapters in a step, or a
request whose adapter must wait holding up the requests behind it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.core.lifecycle import request_path
from engine.messages.lora import LoRARequest
from engine.messages.request import Request, RequestStatus
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


def verify(request: Request, drafts) -> list[int]:
    """Greedy verification: the drafts the model agrees with, then its own next token."""
    tokens, sampled = list(request.all_token_ids), []
    for draft in [*drafts, None]:
        sampled.append(next_token(tokens))
        tokens.append(sampled[-1])
        if sampled[-1] != draft:
            break
    return sampled


def propose(request: Request, num_drafts: int) -> list[int]:
    """A drafter right for a few tokens (how many depends on the sequence), then wrong."""
    tokens = list(request.all_token_ids)
    for _ in range(num_drafts):
        tokens.append(next_token(tokens))
    drafts = tokens[request.num_tokens :]
    wrong = request.num_tokens % (num_drafts + 1)
    if wrong < num_drafts:
        drafts[wrong] = (drafts[wrong] + 1) % VOCAB
    return drafts


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
        self,
        workload,
        num_blocks=12,
        block_size=4,
        budget=16,
        max_num_seqs=4,
        policy="fcfs",
        drafts=0,
        max_steps=3000,
        adapters=(),
        max_loras=1,
    ):
        """``adapters``: each request's LoRA adapter id (None: the base model; none given: no
        LoRA); then no step may hold more than ``max_loras`` of them."""
        lora = {"enable_lora": True, "max_loras": max_loras} if adapters else {}
        path, kv = self.request_path(
            num_blocks,
            block_size=block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            policy=policy,
            **lora,
        )
        requests = []
        for i, (prompt_len, max_tokens, priority) in enumerate(workload):
            prompt = [(i * 13 + j * 5) % VOCAB for j in range(prompt_len)]
            params = SamplingParams(max_tokens=max_tokens)
            request = Request(f"r{i}", prompt, params, priority=priority, lora_request=_adapter(adapters, i))
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
            in_step = {item.request.lora_id for item in plan.scheduled} - {None}
            assert len(in_step) <= max_loras or not adapters, f"adapters {in_step} in one step"
            scheduled = {item.request.request_id for item in plan.scheduled}
            for r in requests:
                if r.request_id in plan.preempted and r.request_id not in scheduled:
                    assert r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0, (
                        "a preempted request starts over"
                    )
                    assert not kv.block_ids(r), "a preempted request's blocks are freed"
            for item in plan.scheduled:
                r = item.request
                assert item.num_new_tokens > 0
                assert len(kv.block_ids(r)) * block_size >= (
                    r.num_computed_tokens + item.num_new_tokens + len(item.spec_token_ids)
                ), "a scheduled token (or draft) has no slot"
            sampled = {
                item.request.request_id: verify(item.request, item.spec_token_ids)
                for item in plan.scheduled
                if item.samples
            }
            path.apply(plan, StepResult(sampled))
            if drafts:
                self._propose(path, plan, drafts, capacity=(num_blocks - 1) * block_size)
        assert not path.has_unfinished(), "every request must finish"
        assert kv.num_free_blocks == num_blocks - 1, "blocks leaked"
        for request, (_, max_tokens, _) in zip(requests, workload):
            assert request.finish_reason == "length"
            assert request.output_token_ids == alone(request.prompt_token_ids, max_tokens), request
        return preemptions

    @staticmethod
    def _propose(path, plan, drafts: int, capacity: int) -> None:
        """Drafts for each running request that decodes, as the core's speculator asks for them."""
        for request in path.running(plan):
            if request.num_computed_tokens != request.num_tokens - 1:  # still prefilling
                continue
            room = min(
                drafts,
                capacity - request.num_tokens - 1,
                request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
            )
            if room > 0 and path.reserve_lookahead(request, room):
                request.spec_token_ids = propose(request, room)

    # one contract class per scheduler (a plugin's, the built-in's) runs this same method
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.differing_executors])
    @given(workload=workloads, choice=st.integers(0, 1), drafts=st.sampled_from([0, 0, 1, 3]))
    def test_random_workloads(self, workload, choice, drafts):
        self.run(workload, policy=self.policies[choice % len(self.policies)], drafts=drafts)

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

    # one test per bug scheduler authors make (tests/test_scheduler_kit_mutations.py plants each)
    def test_decode_tokens_count_against_the_budget(self):
        """``r0`` decodes while ``r1``'s prompt is prefilled in chunks: one budget holds both."""
        self.run([(3, 6, 0), (30, 2, 0)], budget=8)

    def test_draft_tokens_count_against_the_budget(self):
        """``r0`` and ``r1`` decode with 3 drafts each while ``r2``'s prompt waits for budget."""
        self.run([(3, 12, 0), (3, 12, 0), (30, 2, 0)], budget=8, drafts=3)

    def test_no_more_requests_run_than_max_num_seqs(self):
        self.run([(2, 4, 0)] * 6, budget=64, max_num_seqs=2)

    def _serves_lora(self) -> None:
        if not load_plugins().get("schedulers", self.scheduler_name).serves_lora:
            pytest.skip(f"{self.scheduler_name} does not serve LoRA (Scheduler.serves_lora)")

    def test_lora_steps_stay_within_max_loras(self):
        """Requests of four adapters and of the base model interleaved, ``max_loras=2``, a pool
        small enough to preempt: no step holds three adapters, every request finishes as alone."""
        self._serves_lora()
        workload = [(20, 8, 0), (12, 8, 0), (25, 6, 0), (9, 10, 0), (16, 8, 0), (7, 8, 0), (30, 4, 0)]
        self.run(workload, num_blocks=16, budget=16, adapters=[1, 2, None, 3, 1, 4, None], max_loras=2)

    def test_a_request_whose_adapter_must_wait_holds_up_no_one(self):
        """``max_loras=1``: adapter 2's request waits while adapter 1's run, and the base and
        adapter-1 requests queued behind it start in the first step."""
        self._serves_lora()
        workload = [(6, 4, 0), (6, 4, 0), (6, 4, 0), (6, 4, 0)]
        adapters = [1, 2, None, 1]
        path, _ = self.request_path(32, block_size=4, max_num_batched_tokens=64, enable_lora=True)
        for i, (prompt_len, max_tokens, _) in enumerate(workload):
            path.add(
                Request(
                    f"r{i}",
                    [i + 1] * prompt_len,
                    SamplingParams(max_tokens=max_tokens),
                    lora_request=_adapter(adapters, i),
                )
            )
        first = {item.request.request_id for item in path.schedule().scheduled}
        assert first == {"r0", "r2", "r3"}, f"scheduled {sorted(first)}: r1 waits, and only r1"
        self.run(workload, budget=64, adapters=adapters)

    def test_an_aborted_waiting_request_leaves_the_queue(self):
        path, kv = self.request_path(16, block_size=4, max_num_batched_tokens=8, max_num_seqs=1)
        path.add(Request("running", [1, 2, 3], SamplingParams(max_tokens=5)))
        path.add(Request("waiting", [4, 5, 6], SamplingParams(max_tokens=5)))
        assert [s.request.request_id for s in path.schedule().scheduled] == ["running"]
        path.abort(["waiting", "running"])
        assert not path.schedule().scheduled, "an aborted request must leave the queues"
        assert kv.num_free_blocks == 15


def _adapter(adapters, index: int) -> LoRARequest | None:
    """Request ``index``'s adapter: a LoRA request of that id (its files are never read here)."""
    lora_id = adapters[index] if adapters else None
    return None if lora_id is None else LoRARequest(f"adapter-{lora_id}", lora_id, f"adapter-{lora_id}")
