"""KV connector contract: a connector's two halves driven by the core's request lifecycle (which
runs the connector's request protocol), a scheduler (the default one unless ``scheduler_name``
says otherwise) and the default KV cache manager, with the scheduler half's metadata pickled on
its way to the worker half (as if they lived in different processes), and a stand-in model that
writes into real cache tensors a value at each slot that depends on the whole prefix before it
(as K/V do) and emits the next token as a function of the sequence (as greedy decoding does).

Checked every step: before a request computes, every block holding its computed tokens, loaded
or local, holds exactly that prefix's values in every layer (a round trip through the connector
into other block ids is exact). Checked per workload: prefixes evicted from the pool come back
through the connector; a prefix whose head is still in the pool loads only its tail, into the
blocks after the local hit, offering no block the connector does not hold; blocks a request
computes into right after a finish freed them were saved before it; a failed load (injected:
the block is garbled and reported failed) is recomputed and changes no output; preemption beside
loads changes no output; under random workloads with preemption, aborts and failures no block
leaks or is freed twice, and every request's tokens equal what it generates alone. A run fails
after ``stall_steps`` steps in a row that compute nothing and free no block (a load never
reported finished, blocks never reported sent), not by hanging.

A plugin's test subclasses :class:`KVConnectorContract`, sets ``connector_name`` and, if its
connector needs it, overrides :meth:`KVConnectorContract.extra_config` (e.g. a disk path). The
mutants in ``tests/plugins/kv_connector_mutants.py`` are the bugs it is checked to catch.
"""

from __future__ import annotations

import pickle
import tempfile

import attrs
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.core.kv_connectors import build_halves
from engine.core.lifecycle import RequestPath, request_path
from engine.interfaces import KVCacheManager, KVConnector, KVTransferReport
from engine.messages.request import Request
from engine.messages.sampling_params import SamplingParams
from engine.messages.step import StepResult
from engine.plugins import load_plugins
from engine.testing.scheduler import alone, next_token

BLOCK = 4
NUM_LAYERS = 2
WIDTH = 3
BLOCK_DIM = 1  # caches are [2, blocks, BLOCK, WIDTH]: K/V first, as the torch backend's


# test_random_workloads_leak_no_blocks's examples: requests of (prefix index, tail length,
# max_tokens), aborts of (step, request index), a failed load every n blocks (0: none)
RANDOM_WORKLOADS = {
    "workload": st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 14), st.integers(1, 8)), min_size=1, max_size=10
    ),
    "aborts": st.lists(st.tuples(st.integers(0, 40), st.integers(0, 9)), max_size=3),
    "fail_every": st.sampled_from([0, 0, 3]),
}


def slot_value(tokens: list[int], pos: int, layer: int) -> int:
    """The stand-in K/V value of position ``pos``: a function of the prefix up to it and the layer."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens[: pos + 1])) * 31 + layer * 7) % 65521


def _expected(value: int) -> torch.Tensor:
    """[2, WIDTH] float32 entries of one slot (exact: below 2**24)."""
    return (value * 8 + torch.arange(2).view(2, 1) * 4 + torch.arange(WIDTH).view(1, WIDTH)).float()


class _Recorder:
    """The scheduler half, recording which blocks each admission asked the worker to load."""

    def __init__(self, half):
        self.half = half
        self.loads: dict[str, list[int]] = {}

    def update_state_after_alloc(self, request, block_ids, num_local_tokens, num_external_tokens):
        first = num_local_tokens // BLOCK
        if num_external_tokens:
            self.loads[request.request_id] = list(block_ids[first : first + num_external_tokens // BLOCK])
        return self.half.update_state_after_alloc(request, block_ids, num_local_tokens, num_external_tokens)

    def __getattr__(self, name):
        return getattr(self.half, name)


@attrs.define
class ConnectorSim:
    """The step loop of an engine around the connector, with the stand-in model."""

    path: RequestPath  # the scheduler's request path (engine.core.lifecycle)
    kv: KVCacheManager
    recorder: _Recorder
    worker: KVConnector
    caches: list[torch.Tensor]
    num_blocks: int
    fail_every: int = 0  # garble and report failed every n-th block loaded (0: none)
    stall_steps: int = 100  # steps in a row without progress before a run fails
    loaded: int = 0
    failures: int = 0
    steps: int = 0
    last_computed: bool = False

    def add(self, request: Request) -> None:
        self.path.add(request)

    def step(self) -> list:
        """One engine step; returns its outputs."""
        self.steps += 1
        plan = self.path.schedule()
        self.last_computed = bool(plan.scheduled)
        meta = pickle.loads(pickle.dumps(self.recorder.build_connector_meta(plan)))
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv()
        slots = self._slots(plan)
        for layer, cache in enumerate(self.caches):
            self.worker.wait_for_layer_load(layer)
            self._write(plan, layer, cache)
            self.worker.save_kv_layer(layer, cache, slots)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        report = self._inject_failures(plan, self.worker.get_finished())
        self._check_prefixes(plan, report.failed_blocks)
        self.recorder.update_connector_output(report)
        self.path.on_kv_report(report)
        sampled = {
            item.request.request_id: [next_token(item.request.all_token_ids)]
            for item in plan.scheduled
            if item.samples
        }
        return self.path.apply(plan, StepResult(sampled))

    @property
    def stats(self) -> dict:
        """The engine's counters: the scheduler's, the KV cache manager's, the external hits."""
        return self.path.stats()

    def drained(self) -> bool:
        """Every request finished and every block back in the pool (none delayed)."""
        return not self.path.has_unfinished() and self.kv.num_free_blocks == self.num_blocks - 1

    def close(self) -> None:
        self.recorder.half.shutdown()
        self.worker.shutdown()

    def run(self, max_steps: int = 3000, abort_at: dict[int, str] | None = None) -> None:
        """Step until every request finished and the connector released every delayed block;
        fail once ``stall_steps`` steps in a row computed nothing and freed no block (a load that
        never lands, blocks held forever) rather than step on to ``max_steps``."""
        stalled = 0
        for _ in range(max_steps):
            if abort_at and self.steps in abort_at:
                self.path.abort([abort_at[self.steps]])
            if self.drained():
                return
            free = self.kv.num_free_blocks
            self.step()
            stalled = 0 if self.last_computed or self.kv.num_free_blocks != free else stalled + 1
            if stalled >= self.stall_steps:
                raise AssertionError(
                    f"{stalled} steps in a row computed nothing and freed no block: a load the connector"
                    " never reports finished, or blocks it never reports sent"
                )
        raise AssertionError("requests did not finish, or the connector held blocks forever")

    def _slots(self, plan) -> torch.Tensor:
        slots = []
        for item in plan.scheduled:
            table, start = self.kv.block_ids(item.request), item.request.num_computed_tokens
            slots += [
                table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + item.num_new_tokens)
            ]
        return torch.tensor(slots, dtype=torch.int64)

    def _write(self, plan, layer: int, cache: torch.Tensor) -> None:
        for item in plan.scheduled:
            request, table = item.request, self.kv.block_ids(item.request)
            for pos in range(request.num_computed_tokens, request.num_computed_tokens + item.num_new_tokens):
                value = slot_value(request.all_token_ids, pos, layer)
                cache[:, table[pos // BLOCK], pos % BLOCK] = _expected(value)

    def _inject_failures(self, plan, report: KVTransferReport) -> KVTransferReport:
        landed = [
            rid
            for rid in self.recorder.loads
            if rid in report.finished_loading
            or any(item.request.request_id == rid for item in plan.scheduled)
        ]
        failed = set(report.failed_blocks)
        for rid in landed:
            for block in self.recorder.loads.pop(rid):
                self.loaded += 1
                if self.fail_every and self.loaded % self.fail_every == 0:
                    for cache in self.caches:
                        cache.select(BLOCK_DIM, block).fill_(-1.0)
                    failed.add(block)
        self.failures += len(failed)
        return attrs.evolve(report, failed_blocks=frozenset(failed))

    def _check_prefixes(self, plan, failed: frozenset[int]) -> None:
        for item in plan.scheduled:
            request, table = item.request, self.kv.block_ids(item.request)
            if failed.intersection(table) or request.is_finished:
                continue  # its step is void: the core rolls it back
            for pos in range(request.num_computed_tokens):
                for layer, cache in enumerate(self.caches):
                    got = cache[:, table[pos // BLOCK], pos % BLOCK]
                    assert torch.equal(got, _expected(slot_value(request.all_token_ids, pos, layer))), (
                        f"{request.request_id}: block {table[pos // BLOCK]} holds the wrong K/V"
                        f" at position {pos}"
                    )


class KVConnectorContract:
    connector_name: str = ""
    scheduler_name: str = "default"  # the connector's protocol must hold under any scheduler
    stall_steps: int = 100  # raise it for a connector whose own threads may take longer to land a load

    def extra_config(self, folder: str) -> dict:
        """``kv_connector_extra_config`` for the connector; ``folder`` is a fresh directory."""
        return {}

    def make(
        self, folder: str, num_blocks: int = 16, budget: int = 16, max_num_seqs: int = 4, fail_every: int = 0
    ) -> ConnectorSim:
        return self.make_sim(
            {"kv_connector": self.connector_name, "kv_connector_extra_config": self.extra_config(folder)},
            num_blocks,
            budget,
            max_num_seqs,
            fail_every,
        )

    def make_sim(
        self, transfer_config: dict, num_blocks: int, budget: int, max_num_seqs: int, fail_every: int = 0
    ) -> ConnectorSim:
        config = EngineConfig.from_kwargs(
            block_size=BLOCK,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            kv_transfer_config=transfer_config,
            scheduler=self.scheduler_name,
        )
        registry = load_plugins()
        kv = registry.get("kv_cache_managers", "default")(config, num_blocks)
        caches = [torch.zeros(2, num_blocks, BLOCK, WIDTH) for _ in range(NUM_LAYERS)]
        scheduler_half, worker = build_halves(registry, config, caches, BLOCK_DIM)
        worker.register_kv_caches(caches, BLOCK_DIM)
        recorder = _Recorder(scheduler_half)
        path = request_path(registry, config, kv, recorder, (num_blocks - 1) * BLOCK)
        return ConnectorSim(path, kv, recorder, worker, caches, num_blocks, fail_every, self.stall_steps)

    def assert_other_blocks(self, request: Request, loaded_into: list[int], held_before: list[int]) -> None:
        """The round trip's blocks were not where the loaded values were before."""
        assert loaded_into != held_before, "the test meant other block ids"

    def test_round_trip_into_other_blocks_after_eviction(self, tmp_path):
        sim = self.make(str(tmp_path))
        shared = [(7 * j + 3) % 97 for j in range(24)]
        first = Request("first", shared + [1, 2], SamplingParams(max_tokens=3))
        sim.add(first)
        first_blocks = []
        while sim.path.has_unfinished():
            first_blocks = list(sim.kv.block_ids(first)) or first_blocks
            sim.step()
        for i in range(3):  # other prompts take the whole pool: the shared prefix is evicted
            sim.add(
                Request(f"filler{i}", [(11 * j + i) % 97 for j in range(40)], SamplingParams(max_tokens=2))
            )
        sim.run()
        assert sim.kv.get_computed_blocks(Request("probe", shared + [5], SamplingParams()))[1] == 0
        hits_before = sim.stats["external_prefix_hits"]
        second = Request("second", shared + [9, 9, 9], SamplingParams(max_tokens=4))
        sim.add(second)
        sim.step()
        loaded_into = sim.kv.block_ids(second)[:6]
        sim.run()
        assert sim.stats["external_prefix_hits"] - hits_before == 24, "the evicted prefix did not load"
        self.assert_other_blocks(second, loaded_into, first_blocks[:6])
        assert second.output_token_ids == alone(second.prompt_token_ids, 4)

    def test_local_prefix_hit_loads_nothing(self, tmp_path):
        sim = self.make(str(tmp_path), num_blocks=32)
        shared = [(5 * j + 1) % 97 for j in range(16)]
        sim.add(Request("a", shared + [1], SamplingParams(max_tokens=2)))
        sim.run()
        hits_before = sim.stats["external_prefix_hits"]
        sim.add(Request("b", shared + [2], SamplingParams(max_tokens=2)))
        sim.run()
        assert sim.stats["external_prefix_hits"] == hits_before
        assert sim.kv.stats["prefix_hits"] == 16

    def test_a_prefix_partly_in_the_pool_loads_only_the_rest(self, tmp_path):
        sim = self.make(str(tmp_path))
        shared = [(7 * j + 5) % 97 for j in range(24)]
        sim.add(Request("seed", shared + [1], SamplingParams(max_tokens=1)))
        sim.run()
        # 11 blocks: the 8 never used, then the seed's last three (freed tail first)
        sim.add(Request("filler", [(11 * j + 2) % 97 for j in range(44)], SamplingParams(max_tokens=1)))
        sim.run()
        probe = Request("probe", shared + [5], SamplingParams())
        assert sim.kv.get_computed_blocks(probe)[1] == 16, "the test meant the prefix's head left in the pool"
        local_before, failures_before = sim.kv.stats["prefix_hits"], sim.stats["kv_load_failures"]
        external_before = sim.stats["external_prefix_hits"]
        # longer than what the connector holds: an offer counted from the prompt's start shows
        second = Request("second", shared + [9] * 12, SamplingParams(max_tokens=4))
        sim.add(second)
        sim.run()
        assert sim.kv.stats["prefix_hits"] - local_before == 16
        assert sim.stats["external_prefix_hits"] - external_before >= 8, "the evicted blocks did not load"
        assert sim.stats["kv_load_failures"] == failures_before, "it offered blocks it does not hold"
        assert second.output_token_ids == alone(second.prompt_token_ids, 4)

    def test_blocks_reused_right_after_a_finish_were_saved_first(self, tmp_path):
        sim = self.make(str(tmp_path), num_blocks=8)
        shared = [(13 * j + 6) % 97 for j in range(24)]
        sim.add(Request("seed", shared, SamplingParams(max_tokens=1)))
        sim.run()
        # the very next step computes this one in the seed's freed blocks (the one never used first)
        sim.add(Request("filler", [(3 * j + 8) % 97 for j in range(16)], SamplingParams(max_tokens=1)))
        sim.run()
        probe = Request("probe", shared + [5], SamplingParams())
        assert sim.kv.get_computed_blocks(probe)[1] == 12, "the test meant the seed's blocks reused"
        hits_before = sim.stats["external_prefix_hits"]
        second = Request("second", shared + [2], SamplingParams(max_tokens=3))
        sim.add(second)
        sim.run()
        assert sim.stats["external_prefix_hits"] - hits_before == 12, "the reused blocks did not load"
        assert second.output_token_ids == alone(second.prompt_token_ids, 3)

    def test_failed_loads_recompute_to_the_same_output(self, tmp_path):
        sim = self.make(str(tmp_path), fail_every=2)
        shared = [(3 * j + 2) % 97 for j in range(24)]
        sim.add(Request("first", shared + [4], SamplingParams(max_tokens=2)))
        sim.run()
        for i in range(3):
            sim.add(
                Request(f"filler{i}", [(13 * j + i) % 97 for j in range(40)], SamplingParams(max_tokens=2))
            )
        sim.run()
        second = Request("second", shared + [8, 8], SamplingParams(max_tokens=5))
        sim.add(second)
        sim.run()
        assert sim.failures > 0 and sim.stats["kv_load_failures"] > 0
        assert second.output_token_ids == alone(second.prompt_token_ids, 5)

    def test_preemption_beside_loads_changes_no_output(self, tmp_path):
        sim = self.make(str(tmp_path), num_blocks=14, budget=16)
        shared = [(9 * j + 4) % 97 for j in range(16)]
        sim.add(Request("seed", shared + [3], SamplingParams(max_tokens=1)))
        sim.run()
        for i in range(3):  # evict the shared prefix from the pool
            sim.add(
                Request(f"filler{i}", [(17 * j + i) % 97 for j in range(40)], SamplingParams(max_tokens=1))
            )
        sim.run()
        requests = [
            Request(f"r{i}", shared + [i + 1] * (4 + 3 * i), SamplingParams(max_tokens=12)) for i in range(4)
        ]
        for request in requests:
            sim.add(request)
        sim.run()
        assert sim.stats["preemptions"] > 0, "the test meant a pool small enough to preempt"
        assert sim.stats["external_prefix_hits"] > 0
        for request in requests:
            assert request.output_token_ids == alone(request.prompt_token_ids, 12), request

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.differing_executors])
    @given(**RANDOM_WORKLOADS)
    def test_random_workloads_leak_no_blocks(self, workload, aborts, fail_every):
        self.check_random_workload(workload, aborts, fail_every)

    def check_random_workload(self, workload, aborts, fail_every) -> None:
        """Requests of (shared prefix, tail length, max_tokens), some aborted at a step: every one
        not aborted generates what it would alone, and the run ends with every block free."""
        prefixes = [[(7 * j + 1) % 97 for j in range(12)], [(5 * j + 3) % 97 for j in range(8)], []]
        with tempfile.TemporaryDirectory() as folder:
            sim = self.make(folder, num_blocks=14, budget=16, fail_every=fail_every)
            requests = []
            for i, (prefix, tail, max_tokens) in enumerate(workload):
                prompt = prefixes[prefix] + [(i * 13 + j * 5) % 97 for j in range(tail)]
                requests.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens)))
                sim.add(requests[-1])
            sim.run(abort_at={step: f"r{index % len(workload)}" for step, index in aborts})
            for request, (_, _, max_tokens) in zip(requests, workload):
                if request.finish_reason != "abort":
                    assert request.output_token_ids == alone(request.prompt_token_ids, max_tokens), request
