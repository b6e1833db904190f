"""LoRA slots of one fused linear layer: the adapters a step may use, each in a fixed slot of
preallocated tensors, and the delta they add to the base matmul's output.

A layer with n fused output shards (q|k|v: 3, gate|up: 2, o_proj and down_proj: 1) holds, for
``max_loras`` slots of rank ``max_rank``: ``a`` [S, n, R, K], ``b`` [S, R, N] (B transposed:
column j holds output j's B row against its shard's rank, so a kernel adding the delta reads
each rank's row of outputs contiguously), ``scale`` [S, n] (lora_alpha / r, or / √r with rsLoRA; zero where
an adapter leaves a shard out) and ``ranks`` [S, n] (each adapter's rank per shard: a kernel reads
no zero row of A past it). Loading an adapter into a slot copies into these tensors: a step
never allocates them. Which row runs which slot is the step's :class:`LoRABatch`, one object
every layer of the model shares and the engine sets before each forward; the delta is computed
by the platform's :meth:`engine.layers.LayerOps.lora_shrink` and ``lora_expand``, in the
activation dtype, on top of whatever the base matmul is (any quant method)."""

from __future__ import annotations

import torch

from engine.layers.module import Layer
from engine.layers.ops import LayerOps


class LoRABatch:
    """This step's slot per flattened row (int64 [T], -1: the base model), or None when no row
    runs an adapter, so the layers skip LoRA entirely. While a decode step is recorded
    (:mod:`engine.runner.step_graphs`) it is the bucket's static buffer, which each replay fills."""

    def __init__(self):
        self.indices: torch.Tensor | None = None


class LoRASlots(Layer):
    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device,
        batch: LoRABatch,
        ops: LayerOps,
    ):
        super().__init__()
        self.output_sizes = tuple(output_sizes)
        self.batch, self.ops = batch, ops
        n, like = len(output_sizes), {"dtype": dtype, "device": device}
        self.register_buffer("a", torch.zeros(max_loras, n, max_rank, input_size, **like))
        self.register_buffer("b", torch.zeros(max_loras, max_rank, sum(output_sizes), **like))
        self.register_buffer("scale", torch.zeros(max_loras, n, device=device))
        # each slot's and shard's adapter rank: the shrink reads no zero row past it
        self.register_buffer("ranks", torch.zeros(max_loras, n, dtype=torch.int64, device=device))

    def load(self, slot: int, shards) -> None:
        """Fill ``slot`` with one adapter's weights: ``shards[i]`` is (A [r, K], B [N_i, r], scale)
        of fused shard i, or None where the adapter does not adapt it."""
        self.clear(slot)
        start = 0
        for index, (size, shard) in enumerate(zip(self.output_sizes, shards)):
            if shard is not None:
                a, b, scale = shard
                rank = a.shape[0]
                self.a[slot, index, :rank].copy_(a)
                self.b[slot, :rank, start : start + size].copy_(b.T)
                self.scale[slot, index] = scale
                self.ranks[slot, index] = rank
            start += size

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scale[slot].zero_()
        self.ranks[slot].zero_()

    def add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (the base matmul of x, consumed) plus this step's LoRA deltas."""
        indices = self.batch.indices
        if indices is None:
            return y
        h = self.ops.lora_shrink(x, self.a, self.scale, indices, self.ranks)
        return self.ops.lora_expand(y, h, self.b, indices, self.output_sizes)
