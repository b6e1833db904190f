"""OffloadConnector: both halves of the ``offload`` KV connector.

Scheduler half: an LRU index of the block hashes the tiers hold, sized in blocks from the byte
capacities. A finished request's computed full blocks not yet stored are ordered saved (write
through: they stay intact in the device pool until the next forward, which the saves precede);
a waiting request's blocks after the local prefix-cache hit that the index holds are loaded
(synchronously: they land inside the step, layer by layer). When the index is over capacity its
least recently used keys are ordered evicted — never one this step loads.

Worker half, per step (:class:`OffloadMeta`), in this order: evict; save (device → CPU slot);
load (CPU slot or disk file → device). On CUDA the copies run on a side stream that first waits
for the compute stream; each layer's loads end with an event the compute stream waits on in
``wait_for_layer_load`` (after every save of the step, so a block freed and reused as a load or
compute destination is read before it is overwritten), and ``wait_for_save`` synchronizes the
side stream. On the CPU the copies are plain, and each layer's loads run in its
``wait_for_layer_load``. The CUDA path is correct by construction but was not run here (no GPU).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict

import attrs
import torch

from engine.interfaces import KVConnector, KVTransferReport
from engine_kvconnectors_offload.tiers import BlockStore

DEFAULT_CPU_BYTES = 256 << 20
EXTRA_KEYS = ("cpu_bytes", "disk_path", "disk_bytes")


@attrs.frozen
class OffloadMeta:
    evict: tuple[bytes, ...] = ()
    saves: tuple[tuple[bytes, int], ...] = ()  # (block hash, device block id)
    loads: tuple[tuple[bytes, int], ...] = ()


@attrs.frozen
class Capacity:
    cpu_blocks: int
    disk_blocks: int
    disk_path: str | None

    @classmethod
    def of(cls, extra: dict, block_bytes: int) -> Capacity:
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {unknown} for offload; known: {list(EXTRA_KEYS)}"
            )
        cpu_bytes = _bytes(extra, "cpu_bytes", DEFAULT_CPU_BYTES)
        disk_path = extra.get("disk_path")
        disk_bytes = _bytes(extra, "disk_bytes", 0)
        if disk_bytes and not disk_path:
            raise ValueError("kv_connector_extra_config.disk_bytes: needs disk_path")
        cpu_blocks = cpu_bytes // block_bytes
        if cpu_blocks < 1:
            raise ValueError(
                f"kv_connector_extra_config.cpu_bytes: {cpu_bytes} holds no block "
                f"(one block is {block_bytes} bytes)"
            )
        return cls(cpu_blocks, disk_bytes // block_bytes if disk_path else 0, disk_path)


def _bytes(extra: dict, key: str, default: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"kv_connector_extra_config.{key}: a byte count >= 0, got {value!r}")
    return int(value)


class OffloadConnector(KVConnector):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.capacity = Capacity.of(ctx.extra_config, ctx.block_bytes)
        # scheduler half
        self.index: OrderedDict[bytes, None] = OrderedDict()
        self._saves: list[tuple[bytes, int]] = []
        self._loads: list[tuple[bytes, int]] = []
        self._evict: list[bytes] = []
        self._last_loads: dict[int, bytes] = {}  # device block -> key, of the last metadata's loads
        # worker half
        self.store: BlockStore | None = None
        self.caches: list[torch.Tensor] = []
        self.block_dim = 0
        self._meta = OffloadMeta()
        self._side = None  # the CUDA copy stream
        self._layer_events: list = []
        self._pending: list[tuple[int, torch.Tensor]] = []  # (device block, host source) of this step
        self._report = _ReportBuilder()

    # -- scheduler half ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        hits = 0
        for key in request.block_hashes[num_computed_tokens // self.ctx.block_size :]:
            if key not in self.index:
                break
            hits += 1
        return hits * self.ctx.block_size, False

    def update_state_after_alloc(self, request, block_ids, num_local_tokens, num_external_tokens):
        first = num_local_tokens // self.ctx.block_size
        for i in range(first, first + num_external_tokens // self.ctx.block_size):
            key = request.block_hashes[i]
            self.index.move_to_end(key)
            self._loads.append((key, block_ids[i]))

    def request_finished(self, request, block_ids):
        computed = min(len(request.block_hashes), request.num_computed_tokens // self.ctx.block_size)
        # tail first, so a prefix's head is the most recently used: a hit must start at the head
        for key, block in reversed(list(zip(request.block_hashes[:computed], block_ids))):
            if key in self.index:
                self.index.move_to_end(key)
            else:
                self.index[key] = None
                self._saves.append((key, block))
        self._evict_over_capacity()
        return False

    def _evict_over_capacity(self) -> None:
        excess = len(self.index) - self.capacity.cpu_blocks - self.capacity.disk_blocks
        if excess <= 0:
            return
        busy = {key for key, _ in self._loads} | {key for key, _ in self._saves}
        for key in [k for k in self.index if k not in busy][:excess]:
            del self.index[key]
            self._evict.append(key)

    def build_connector_meta(self, plan):
        self._evict_over_capacity()
        meta = OffloadMeta(tuple(self._evict), tuple(self._saves), tuple(self._loads))
        self._last_loads = {block: key for key, block in self._loads}
        self._evict, self._saves, self._loads = [], [], []
        return meta

    def update_connector_output(self, report):
        """A block whose load failed is no longer offered (it is missing or damaged)."""
        for block in report.failed_blocks:
            key = self._last_loads.get(block)
            if key is not None:
                self.index.pop(key, None)

    def reset_cache(self):
        """Forget every stored block (the weights that computed them changed): each is ordered
        evicted, which the worker half carries out in the next step before that step's saves, and
        saves not yet carried out are dropped."""
        self._evict.extend(self.index)
        self.index.clear()
        self._saves, self._loads, self._last_loads = [], [], {}
        return True

    # -- worker half ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches, block_dim):
        self.caches, self.block_dim = kv_caches, block_dim
        block = kv_caches[0].select(block_dim, 0)
        cuda = kv_caches[0].device.type == "cuda"
        self.store = BlockStore(
            self.capacity.cpu_blocks,
            (len(kv_caches), *block.shape),
            block.dtype,
            self.capacity.disk_path,
            pin=cuda,
        )
        if cuda:
            self._side = torch.cuda.Stream(device=kv_caches[0].device)

    def bind_connector_metadata(self, meta):
        self._meta = meta

    def clear_connector_metadata(self):
        self._meta = OffloadMeta()

    def start_load_kv(self):
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.caches[0].device))
        with torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext():
            for key in self._meta.evict:
                self.store.evict(key)
            self._save(self._meta.saves)
            started = time.perf_counter()
            self._pending = self._sources(self._meta.loads)
            if self._side is not None:
                self._layer_events = [self._load_layer(layer) for layer in range(len(self.caches))]
            self._report.load_seconds += time.perf_counter() - started

    def _save(self, saves) -> None:
        for key, block in saves:
            slot = self.store.slot_for(key, self._sync_side)
            if slot is None:  # no room at all: a later load of it fails and is recomputed
                continue
            for layer, cache in enumerate(self.caches):
                self.store.slab[slot, layer].copy_(cache.select(self.block_dim, block), non_blocking=True)
            self._report.saved_bytes += self.ctx.block_bytes

    def _sources(self, loads) -> list[tuple[int, torch.Tensor]]:
        pending = []
        for key, block in loads:
            source = self.store.source(key)
            if source is None:
                self._report.failed.add(block)
                self.store.evict(key)
                continue
            pending.append((block, source))
            self._report.loaded_bytes += self.ctx.block_bytes
        return pending

    def _load_layer(self, layer: int):
        cache = self.caches[layer]
        for block, source in self._pending:
            cache.select(self.block_dim, block).copy_(source[layer], non_blocking=True)
        if self._side is None:
            return None
        event = torch.cuda.Event()
        event.record(self._side)
        return event

    def wait_for_layer_load(self, layer):
        if self._side is not None:
            if self._layer_events:
                torch.cuda.current_stream(self.caches[0].device).wait_event(self._layer_events[layer])
            return
        if self._pending:
            started = time.perf_counter()
            self._load_layer(layer)
            self._report.load_seconds += time.perf_counter() - started

    def wait_for_save(self):
        self._sync_side()
        self._pending, self._layer_events = [], []

    def _sync_side(self) -> None:
        if self._side is not None:
            self._side.synchronize()

    def get_finished(self):
        report, self._report = self._report.build(), _ReportBuilder()
        return report


class _ReportBuilder:
    def __init__(self):
        self.failed: set[int] = set()
        self.loaded_bytes = self.saved_bytes = 0
        self.load_seconds = 0.0

    def build(self) -> KVTransferReport:
        return KVTransferReport(
            failed_blocks=frozenset(self.failed),
            loaded_bytes=self.loaded_bytes,
            load_seconds=self.load_seconds,
            saved_bytes=self.saved_bytes,
        )
