"""LoRAManager: the adapters of one engine — loaded ones kept in memory (``max_cpu_loras``,
least recently used dropped beyond that and read again when asked for), ``max_loras`` slots
on the model's layers, and each step's row -> slot mapping.

Built over each rank's model after its weights load: every :class:`engine.layers.Linear` named
``qkv_proj``, ``o_proj``, ``gate_up_proj`` or ``down_proj`` gets :class:`LoRASlots`, holding
the rank's part of each adapter (:meth:`engine.layers.Linear.lora_part`). Every rank runs
:meth:`LoRAManager.prepare` on the same rows, step after step, so their slots agree. An
adapter enters a slot when a step first needs it: free slots first, else the one whose
adapter went longest unused and is not in this step. The scheduler keeps a step within
``max_loras`` distinct adapters; a step beyond them is an error here, not a silent mix."""

from __future__ import annotations

import collections
import itertools

import torch

from engine.config import LoRAConfig
from engine.layers.linear import Linear
from engine.layers.lora import LoRABatch, LoRASlots
from engine.layers.ops import LayerOps
from engine.lora.adapter import FUSED_TARGETS, LoRAAdapter, LoRAAdapterError, load_adapter
from engine.messages.lora import LoRARequest

LORA_LAYERS = frozenset(fused for fused, _ in FUSED_TARGETS.values())


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, dtype, device, ops: LayerOps):
        self.config = config
        self.device = device
        self.batch = LoRABatch()
        self.layers: dict[str, LoRASlots] = {}
        self.linears: dict[str, Linear] = {}
        for name, layer in model.named_modules():
            if isinstance(layer, Linear) and name.rpartition(".")[2] in LORA_LAYERS:
                slots = LoRASlots(
                    layer.input_size,
                    layer.output_sizes,
                    config.max_loras,
                    config.max_lora_rank,
                    dtype,
                    device,
                    self.batch,
                    ops,
                )
                layer.lora = slots
                self.layers[name], self.linears[name] = slots, layer
        if not self.layers:
            raise ValueError(f"enable_lora: {type(model).__name__} has no layer LoRA can run on")
        # adapters are checked against the checkpoint's shapes, whatever part this rank holds
        self.targets = {
            name: (layer.full_input_size, tuple(layer.full_output_sizes))
            for name, layer in self.linears.items()
        }
        self._loaded: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self._slot_of: dict[int, int] = {}  # adapter id -> its slot
        self._in_slot: dict[int, LoRARequest] = {}  # slot -> the adapter whose weights it holds
        self._last_used: dict[int, int] = {}  # adapter id -> the step that last used its slot
        self._steps = itertools.count()

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, read and checked once, then kept among the ``max_cpu_loras`` most recently
        used. Raises :class:`LoRAAdapterError` for an adapter the engine refuses, or for an id
        already taken by another adapter."""
        adapter = self._loaded.get(request.lora_int_id)
        if adapter is not None:
            if adapter.request != request:
                raise LoRAAdapterError(
                    f"lora_int_id {request.lora_int_id} is adapter {adapter.request.lora_name!r} "
                    f"({adapter.request.lora_path}); {request.lora_name!r} ({request.lora_path}) "
                    "needs an id of its own"
                )
            self._loaded.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, self.targets, self.config.max_lora_rank)
        self._loaded[request.lora_int_id] = adapter
        while len(self._loaded) > self.config.cpu_loras:
            self._loaded.popitem(last=False)
        return adapter

    @property
    def loaded(self) -> tuple[int, ...]:
        """Ids of the adapters in memory, least recently used first."""
        return tuple(self._loaded)

    def prepare(self, rows: list[tuple[LoRARequest | None, int]]) -> None:
        """Set the step's row -> slot mapping: ``rows`` lists, in the flattened batch's order,
        each scheduled request's adapter (None: the base model) and its row count."""
        requests = {r.lora_int_id: r for r, _ in rows if r is not None}
        if not requests:
            self.batch.indices = None
            return
        if len(requests) > self.config.max_loras:
            raise RuntimeError(
                f"a step holds {len(requests)} LoRA adapters; max_loras is {self.config.max_loras} "
                "(the scheduler must keep a step within it)"
            )
        step = next(self._steps)
        for lora_id, request in requests.items():
            slot = self._slot_of.get(lora_id)
            if slot is None:
                self._fill(self._free_slot(set(requests)), request)
            elif self._in_slot[slot] != request:  # the id now names another adapter's files
                self._fill(slot, request)
            self._last_used[lora_id] = step
        # built as a list, then one tensor: for a decode step's few rows a quarter of the time
        # repeat_interleave over two tensors takes, and as fast for a prompt step's hundreds
        slot_of = [-1 if r is None else self._slot_of[r.lora_int_id] for r, _ in rows]
        per_row = [slot for slot, (_, count) in zip(slot_of, rows) for _ in range(count)]
        self.batch.indices = torch.tensor(per_row, dtype=torch.long, device=self.device)

    def _free_slot(self, needed: set[int]) -> int:
        taken = set(self._slot_of.values())
        free = [slot for slot in range(self.config.max_loras) if slot not in taken]
        if free:
            return free[0]
        victim = min((i for i in self._slot_of if i not in needed), key=self._last_used.__getitem__)
        del self._last_used[victim]
        return self._slot_of.pop(victim)

    def _fill(self, slot: int, request: LoRARequest) -> None:
        """Copy the adapter's weights into ``slot`` of every layer (clearing the layers it
        leaves out): no tensor is allocated."""
        adapter = self.load(request)
        for name, slots in self.layers.items():
            shards = adapter.layers.get(name)
            if shards is None:
                slots.clear(slot)
            else:
                slots.load(slot, self._rank_parts(name, shards))
        self._slot_of[request.lora_int_id] = slot
        self._in_slot[slot] = request

    def _rank_parts(self, name: str, shards):
        """An adapter's shards of layer ``name`` cut to the part this rank holds."""
        layer = self.linears[name]
        return [
            None if shard is None else (*layer.lora_part(index, shard[0], shard[1]), shard[2])
            for index, shard in enumerate(shards)
        ]
