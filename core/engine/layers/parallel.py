"""Tensor-parallel linears (Megatron's split, as vLLM's parallel linears do it).

A :class:`ColumnParallelLinear` splits its output dimension over the ranks: each fused
projection (q|k|v, gate|up) keeps this rank's rows of that projection, so rank r holds its
heads' q, k and v and its slice of gate and up. A :class:`RowParallelLinear` splits its input
dimension: it takes the column-parallel layer's local output and all-reduces its partial
product (one all-reduce per attention block and per MLP). The group is the one being built
(:func:`engine.distributed.current_tensor_parallel`); at one rank both are a plain
:class:`Linear` and load, compute and round exactly as one.

A quant method's parameters declare the dims that shard: ``output_dim`` (rows of the
[out, in] weight) and ``input_dim`` (its columns); a rank's part is the proportional slice
(``QuantMethod.shards_for_tensor_parallel``).
"""

from __future__ import annotations

import attrs
import torch

from engine.distributed import TensorParallel, current_tensor_parallel
from engine.layers.checkpoint import materialize
from engine.layers.linear import Linear


def _proportional(param: torch.Tensor, tensor, dim: int, units: int, start: int, length: int) -> torch.Tensor:
    """Entries [start, start + length) of ``units`` along ``dim`` of a parameter whose ``dim``
    holds ``param.shape[dim] / units`` entries per unit (a packed format holds fewer)."""
    per_unit = param.shape[dim] // units
    return tensor.narrow(dim, start * per_unit, length * per_unit)


class ColumnParallelLinear(Linear):
    """``shards``: per fused projection, (first row, rows) of the checkpoint's projection this
    rank holds; None: an even split of each of ``output_sizes`` (the full sizes)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, method, dtype: torch.dtype,
                 shards: list[tuple[int, int]] | None = None):
        tp = current_tensor_parallel()
        shards = shards or [tp.split(size, "a projection's output size") for size in output_sizes]
        super().__init__(input_size, [length for _, length in shards], bias, method, dtype)
        self.output_shards = shards if tp.size > 1 else None

    def rank_part(self, param: torch.Tensor, tensor, shard: int) -> torch.Tensor:
        dim = getattr(param, "output_dim", None)
        if self.output_shards is None or dim is None:
            return materialize(tensor)
        return _proportional(param, tensor, dim, sum(self.output_sizes), *self.output_shards[shard])


class RowParallelLinear(Linear):
    """[T, input_size / ranks] (this rank's slice of the input) -> [T, output_size], all-reduced;
    the bias is replicated and added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool, method, dtype: torch.dtype):
        tp = current_tensor_parallel()
        start, length = tp.split(input_size, "a row-parallel layer's input size")
        super().__init__(length, [output_size], bias, method, dtype)
        self.tp = tp
        self.input_shard = (start, length) if tp.size > 1 else None

    def rank_part(self, param: torch.Tensor, tensor, shard: int) -> torch.Tensor:
        dim = getattr(param, "input_dim", None)
        if self.input_shard is None or dim is None:
            return materialize(tensor)
        return _proportional(param, tensor, dim, self.input_size, *self.input_shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_shard is None:
            return self.matmul(x, self.bias)
        out = self.tp.all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias


@attrs.frozen
class AttentionHeads:
    """This rank's attention heads: q heads [q_start, q_start + q), kv heads [kv_start,
    kv_start + kv). With fewer kv heads than ranks each kv head is replicated on the ranks
    whose q heads read it."""

    q_start: int
    q: int
    kv_start: int
    kv: int

    def qkv_shards(self, head_dim: int) -> list[tuple[int, int]]:
        """(first row, rows) of the checkpoint's q, k and v projections."""
        kv = (self.kv_start * head_dim, self.kv * head_dim)
        return [(self.q_start * head_dim, self.q * head_dim), kv, kv]


def attention_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> AttentionHeads:
    q_start, q = tp.split(num_heads, "num_attention_heads")
    if num_kv_heads >= tp.size:
        kv_start, kv = tp.split(num_kv_heads, "num_key_value_heads")
        return AttentionHeads(q_start, q, kv_start, kv)
    if tp.size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size: {tp.size} ranks cannot share {num_kv_heads} kv heads "
                         "(replicating them needs ranks to be a multiple of the kv heads)")
    return AttentionHeads(q_start, q, tp.rank * num_kv_heads // tp.size, 1)
