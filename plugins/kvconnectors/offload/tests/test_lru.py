"""The tiers' capacity: past it the least recently used blocks go, a prefix's tail before its
head (a hit must start at the head), and what is left still reloads exactly (the contract's
stand-in model checks every loaded block)."""

from engine.interfaces import Request
from engine.messages.sampling_params import SamplingParams
from engine.testing.kv_connector import BLOCK, NUM_LAYERS, WIDTH, KVConnectorContract, alone

BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK * WIDTH * 4


class _EightBlocks(KVConnectorContract):  # not collected: only its make() is used
    connector_name = "offload"

    def extra_config(self, folder):
        return {"cpu_bytes": 8 * BLOCK_BYTES}


def test_capacity_evicts_least_recent_tails_first(tmp_path):
    sim = _EightBlocks().make(str(tmp_path), num_blocks=8)  # the second prompt evicts the first from the pool
    first = [(7 * j + 3) % 97 for j in range(24)]
    sim.add(Request("first", first + [1], SamplingParams(max_tokens=2)))
    sim.run()
    sim.add(Request("second", [(5 * j + 2) % 97 for j in range(24)] + [1], SamplingParams(max_tokens=2)))
    sim.run()  # 12 blocks saved into 8: the first prompt's last 4 blocks go
    sim.add(Request("probe", [0], SamplingParams(max_tokens=1)))
    sim.run()  # the worker half applies the last evictions
    assert len(sim.worker.store.cpu) <= 8 and len(sim.recorder.index) <= 8
    again = Request("again", first + [9], SamplingParams(max_tokens=3))
    hits_before = sim.stats["external_prefix_hits"]
    sim.add(again)
    sim.run()
    assert sim.stats["external_prefix_hits"] - hits_before == 2 * BLOCK
    assert again.output_token_ids == alone(again.prompt_token_ids, 3)
