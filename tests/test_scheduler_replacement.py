"""Replacing the scheduler: a policy written against scheduler interface v3 (a ~60-line FCFS,
tests/plugins/fcfs_scheduler.py) passes the scheduler contract and runs the KV connector and P/D
contracts without a line of connector logic of its own; and a scheduler built for interface v2
(tests/old_plugins/scheduler_v2.py, frozen) still loads and generates what the default does."""

from __future__ import annotations

import pytest

from engine.plugins import add_plugin
from engine.testing.kv_connector import KVConnectorContract
from engine.testing.pd_connector import PDConnectorContract
from engine.testing.scheduler import SchedulerContract
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
