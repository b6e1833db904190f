"""Planted bugs: the test memory connector (``tests/plugins/memory_connector.py``) and the offload
connector with one mistake each, the mistakes KV connector authors make. Registered here with
the correct connectors they are copies of (``CORRECT``), not by the suite's conftest:
``tests/test_kv_connector_kit_mutations.py`` runs the KV connector kit on each in a child pytest
and checks that the correct ones pass it and each mutant fails it."""

from __future__ import annotations

from engine import hookimpl
from engine_kvconnectors_offload.connector import OffloadConnector
from tests.plugins.memory_connector import MemoryConnector


class AsyncMemoryConnector(MemoryConnector):
    """The test memory connector with asynchronous loads (landing one step later): correct."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.asynchronous = True


class LoadsFromTableStart(OffloadConnector):
    """Loads the i-th offered block into the request's i-th block, not the i-th after its local
    prefix hit: right whenever nothing of the prefix is left in the pool."""

    def update_state_after_alloc(self, request, block_ids, num_local_tokens, num_external_tokens):
        first, size = num_local_tokens // self.ctx.block_size, self.ctx.block_size
        for i, key in enumerate(request.block_hashes[first : first + num_external_tokens // size]):
            self.index.move_to_end(key)
            self._loads.append((key, block_ids[i]))


class CountsTheLocalHit(MemoryConnector):
    """Counts its hit from the prompt's first block, not from the local prefix hit's end: offers
    the blocks the pool holds again, and so more tokens than it holds."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        hits = 0
        for h in request.block_hashes:
            if h not in self.stored:
                break
            hits += 1
        return hits * self.ctx.block_size, False


class FirstLayerOnly(OffloadConnector):
    """Drops the step's pending loads once they are in place, which is after the first layer's:
    every later layer keeps the K/V of whatever the block held before."""

    def wait_for_layer_load(self, layer):
        super().wait_for_layer_load(layer)
        self._pending = []


class IdleStepsLandNothing(AsyncMemoryConnector):
    """Skips a step whose metadata orders nothing, loads in flight included: a request parked for
    a load stays parked while nothing else arrives."""

    def start_load_kv(self):
        if self.meta["saves"] or self.meta["loads"]:
            super().start_load_kv()


class SavesAfterTheFree(MemoryConnector):
    """Copies a finished request's blocks out a step late (an asynchronous save) but lets the
    engine free them at once: a request given those blocks overwrites them first."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.late: list[tuple[bytes, int]] = []

    def start_load_kv(self):
        late, self.late = self.late, list(self.meta["saves"])
        self.meta = {**self.meta, "saves": late}
        super().start_load_kv()


class NeverSent(MemoryConnector):
    """Delays freeing a finished request's blocks until its save is done, and never says it is
    done: the blocks are held forever."""

    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        return True


CORRECT = {"memory": MemoryConnector, "memory-async": AsyncMemoryConnector, "cpu-offload": OffloadConnector}
MUTANTS = {
    "loads-from-table-start": LoadsFromTableStart,
    "counts-the-local-hit": CountsTheLocalHit,
    "first-layer-only": FirstLayerOnly,
    "idle-steps-land-nothing": IdleStepsLandNothing,
    "saves-after-the-free": SavesAfterTheFree,
    "never-sent": NeverSent,
}


@hookimpl
def register_kv_connectors(register):
    for name, connector in {**CORRECT, **MUTANTS}.items():
        register(name, connector, api=2)
