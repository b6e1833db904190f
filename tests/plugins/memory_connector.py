"""Test plugin for the KV connector seam (interface v2): an in-memory store of finished requests'
full blocks keyed by block hash, loaded back into new requests' blocks instead of being recomputed.

``kv_connector_extra_config``: ``async`` (loads land one step later, the request parked meanwhile),
``fail_every`` (report every n-th loaded block failed). The worker half records its hook calls in
``events`` so a test can check they happen per layer inside the forward."""

from __future__ import annotations

import torch

from engine import hookimpl
from engine.interfaces import KVConnector, KVTransferReport


@hookimpl
def register_kv_connectors(register):
    register("test-memory", MemoryConnector, api=2)


class MemoryConnector(KVConnector):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.asynchronous = bool(ctx.extra_config.get("async", False))
        self.fail_every = int(ctx.extra_config.get("fail_every", 0))
        # scheduler half
        self.stored: set[bytes] = set()
        self.loads: list[tuple[str, bytes, int]] = []  # (request id, hash, destination block)
        self.saves: list[tuple[bytes, int]] = []
        # worker half
        self.caches: list[torch.Tensor] = []
        self.block_dim = 1
        self.store: dict[bytes, list[torch.Tensor]] = {}
        self.meta = None
        self.in_flight: list[tuple[str, bytes, int]] = []  # asynchronous loads, landing next step
        self.report = KVTransferReport()
        self.loaded_blocks = 0
        self.events: list[tuple[str, int]] = []

    # -- scheduler half ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        first = num_computed_tokens // self.ctx.block_size
        hits = 0
        for h in request.block_hashes[first:]:
            if h not in self.stored:
                break
            hits += 1
        return hits * self.ctx.block_size, self.asynchronous and hits > 0

    def update_state_after_alloc(self, request, block_ids, num_local_tokens, num_external_tokens):
        first, bs = num_local_tokens // self.ctx.block_size, self.ctx.block_size
        for i in range(first, first + num_external_tokens // bs):
            self.loads.append((request.request_id, request.block_hashes[i], block_ids[i]))

    def request_finished(self, request, block_ids):
        computed = request.num_computed_tokens // self.ctx.block_size
        for h, block in zip(request.block_hashes[:computed], block_ids):
            if h not in self.stored:
                self.stored.add(h)
                self.saves.append((h, block))
        return False

    def build_connector_meta(self, plan):
        meta = {"saves": self.saves, "loads": self.loads}
        self.saves, self.loads = [], []
        return meta

    def update_connector_output(self, report):
        pass

    # -- worker half ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches, block_dim):
        self.caches, self.block_dim = kv_caches, block_dim

    def bind_connector_metadata(self, meta):
        self.meta = meta

    def clear_connector_metadata(self):
        self.meta = None

    def start_load_kv(self):
        self.events.append(("start", -1))
        for h, block in self.meta["saves"]:
            self.store[h] = [cache.select(self.block_dim, block).clone() for cache in self.caches]
        landed, self.in_flight = self.in_flight, []
        now = list(self.meta["loads"])
        if self.asynchronous:
            self.in_flight, now = now, []
        failed = self._copy_in(landed + now)
        self.report = KVTransferReport(
            finished_loading=frozenset(rid for rid, _, _ in landed), failed_blocks=frozenset(failed)
        )

    def _copy_in(self, loads) -> list[int]:
        failed = []
        for _, h, block in loads:
            self.loaded_blocks += 1
            if self.fail_every and self.loaded_blocks % self.fail_every == 0:
                failed.append(block)
                continue
            for cache, saved in zip(self.caches, self.store[h]):
                cache.select(self.block_dim, block).copy_(saved)
        return failed

    def wait_for_layer_load(self, layer):
        self.events.append(("load", layer))

    def save_kv_layer(self, layer, kv_cache, slot_mapping):
        assert kv_cache is self.caches[layer] and slot_mapping.dtype == torch.int64
        self.events.append(("save", layer))

    def get_finished(self):
        report, self.report = self.report, KVTransferReport()
        return report
