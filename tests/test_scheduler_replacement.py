"""Replacing the scheduler: a policy written against scheduler interface v3 (a ~60-line FCFS,
tests/plugins/fcfs_scheduler.py) passes the scheduler contract and runs the KV connector and P/D
contracts without a line of connector logic of its own; and a scheduler built for interface v2
(tests/old_plugins/scheduler_v2.py, frozen) still loads and generates what the default does."""

from __future__ import annotations

import pytest

from engine.messages.request import Request
from engine.messages.sampling_params import SamplingParams
from engine.plugins import add_plugin
from engine.testing.kv_connector import KVConnectorContract
from engine.testing.pd_connector import PDConnectorContract
from engine.testing.scheduler import SchedulerContract, alone
from tests.old_plugins import scheduler_v2
from tests.plugins import fcfs_scheduler

add_plugin(fcfs_scheduler, "test-fcfs")
add_plugin(scheduler_v2, "old-scheduler-v2")


class TestFCFSSchedulerContract(SchedulerContract):
    scheduler_name = "test-fcfs"
    policies = ("fcfs",)


class TestFCFSWithMemoryConnector(KVConnectorContract):
    scheduler_name = "test-fcfs"
    connector_name = "test-memory"


class TestFCFSWithAsynchronousLoads(KVConnectorContract):
    scheduler_name = "test-fcfs"
    connector_name = "test-memory"

    def extra_config(self, folder):
        return {"async": True}

    def test_a_request_preempted_ahead_of_a_resumed_one_finishes(self, tmp_path):
        """A preempted request goes back to the head of the queue, ahead of one whose load ended
        and holds its blocks; with nothing running, that one must give its blocks back (the P/D
        contract's random workloads stalled on this whenever a transfer took a few steps)."""
        sim = self.make(str(tmp_path), num_blocks=14)
        shared = [(7 * j + 2) % 97 for j in range(24)]
        sim.add(Request("seed", shared + [1], SamplingParams(max_tokens=1)))
        sim.run()
        for i in range(3):  # the seed's prefix leaves the pool: it loads through the connector
            filler = [(11 * j + i) % 97 for j in range(40)]
            sim.add(Request(f"filler{i}", filler, SamplingParams(max_tokens=1)))
        sim.run()
        # "long" takes the pool while "loaded" parks for its 6 blocks; its growth then preempts it
        long = Request("long", [(3 * j + 5) % 97 for j in range(24)], SamplingParams(max_tokens=10))
        loaded = Request("loaded", shared + [9], SamplingParams(max_tokens=2))
        sim.add(long)
        sim.add(loaded)
        for _ in range(20):
            sim.step()
            if sim.stats["preemptions"]:
                break
        assert sim.stats["preemptions"] == 1 and sim.path.kv.resumed() == [loaded], (
            "the test meant a preemption with a resumed request behind the victim"
        )
        sim.run()
        assert long.output_token_ids == alone(long.prompt_token_ids, 10)
        assert loaded.output_token_ids == alone(loaded.prompt_token_ids, 2)


class TestFCFSWithPD(PDConnectorContract):
    scheduler_name = "test-fcfs"
    connector_name = "p2p"

    @pytest.fixture(autouse=True)
    def _p2p_installed(self):
        pytest.importorskip("engine_kvconnectors_p2p", reason="the p2p connector plugin is not installed")


def test_a_v2_scheduler_runs_through_the_adapter_and_matches_the_default(tiny_llama):
    from engine import LLM, SamplingParams

    prompts = [[1, 5, 9, 13], [1, 7, 7, 7, 7, 2, 3], [1, 4]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = {}
    for scheduler in ("default", "old-fcfs"):
        llm = LLM(tiny_llama[0], dtype="float32", num_blocks=64, block_size=16, scheduler=scheduler)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        outputs[scheduler] = [list(o.outputs[0].token_ids) for o in results]
        if scheduler == "old-fcfs":
            assert type(llm.engine.lifecycle).__name__ == "SchedulerV2Lifecycle"
        llm.engine.shutdown()
    assert outputs["old-fcfs"] == outputs["default"]
