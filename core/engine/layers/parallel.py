"""Tensor-parallel linears (Megatron's split, as vLLM's parallel linears do it).

A :class:`ColumnParallelLinear` splits its output dimension over the ranks: each fused
projection (q|k|v, gate|up) keeps this rank's rows of that projection, so rank r holds its
heads' q, k and v and its slice of gate and up. A :class:`RowParallelLinear` splits its input
dimension: it takes the column-parallel layer's local output and all-reduces its partial
product (one all-reduce per attention block and per MLP). The group is the one being built
(:func:`engine.distributed.current_tensor_parallel`); at one rank both are a plain
:class:`Linear` and load, compute and round exactly as one.

A quant method's parameters declare the dims that shard: ``output_dim`` (rows of the
[out, in] weight) and ``input_dim`` (its columns); a rank's part is the proportional slice of
the checkpoint tensor (``QuantMethod.shards_for_tensor_parallel``).

Attention is split by kv-head groups (:func:`attention_heads`, the one rule the layers, the
loading and the KV cache sizing use): unevenly where the kv heads do not divide by the ranks,
the first ranks taking one more.
"""

from __future__ import annotations

import attrs
import torch

from engine.distributed import TensorParallel, current_tensor_parallel
from engine.layers.checkpoint import materialize
from engine.layers.linear import Linear


def proportional_part(tensor, dim: int, full: int, start: int, length: int) -> torch.Tensor:
    """Entries [start, start + length) of the ``full`` a checkpoint tensor's ``dim`` stands for
    (a packed format stores fewer entries per unit: the slice is scaled to what it stores)."""
    stored = tensor.shape[dim]
    if (start * stored) % full or (length * stored) % full:
        raise ValueError(
            f"tensor_parallel_size: a checkpoint tensor's dim {dim} stores {stored} entries for "
            f"{full}; entries [{start}, {start + length}) do not fall on whole stored entries"
        )
    return tensor.narrow(dim, start * stored // full, length * stored // full)


class ColumnParallelLinear(Linear):
    """``shards``: per fused projection, (first row, rows) of the checkpoint's projection this
    rank holds; None: an even split of each of ``output_sizes`` (the full sizes)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        method,
        dtype: torch.dtype,
        shards: list[tuple[int, int]] | None = None,
    ):
        tp = current_tensor_parallel()
        shards = shards or [tp.split(size, "a projection's output size") for size in output_sizes]
        super().__init__(input_size, [length for _, length in shards], bias, method, dtype)
        self.output_shards = shards if tp.size > 1 else None
        self.full_output_sizes = list(output_sizes)

    def rank_part(self, param: torch.Tensor, tensor, shard: int) -> torch.Tensor:
        dim = getattr(param, "output_dim", None)
        if self.output_shards is None or dim is None:
            return materialize(tensor)
        return proportional_part(tensor, dim, self.full_output_sizes[shard], *self.output_shards[shard])

    def lora_part(self, shard: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole, B's rows of this rank's outputs: the delta of this rank's rows."""
        if self.output_shards is None:
            return a, b
        start, length = self.output_shards[shard]
        return a, b[start : start + length]


class RowParallelLinear(Linear):
    """[T, this rank's input columns] -> [T, output_size], all-reduced; ``shard``: (first
    column, columns) of the checkpoint's input this rank holds (None: an even split). The
    bias is replicated and added once, after the reduction. ``reduce_results=False`` returns
    the rank's partial product for the caller to reduce with others in one all-reduce (a MoE
    layer's shared expert beside its routed experts); such a layer takes no bias."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        method,
        dtype: torch.dtype,
        shard: tuple[int, int] | None = None,
        reduce_results: bool = True,
    ):
        if bias and not reduce_results:
            raise ValueError("a row-parallel layer that leaves its reduction to the caller takes no bias")
        tp = current_tensor_parallel()
        start, length = shard or tp.split(input_size, "a row-parallel layer's input size")
        super().__init__(length, [output_size], bias, method, dtype)
        self.tp, self.full_input_size = tp, input_size
        self.input_shard = (start, length) if tp.size > 1 else None
        self.reduce_results = reduce_results

    def rank_part(self, param: torch.Tensor, tensor, shard: int) -> torch.Tensor:
        dim = getattr(param, "input_dim", None)
        if self.input_shard is None or dim is None:
            return materialize(tensor)
        return proportional_part(tensor, dim, self.full_input_size, *self.input_shard)

    def lora_part(self, shard: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A's columns of this rank's inputs, B whole: each rank adds B·(A_r·x_r) before the
        all-reduce, which sums them to B·(A·x)."""
        if self.input_shard is None:
            return a, b
        start, length = self.input_shard
        return a[:, start : start + length], b

    def full_row_max(self, values: torch.Tensor) -> torch.Tensor:
        """The ranks' per-row ``values`` maxed over the group: each rank holds a part of every row."""
        return values if self.input_shard is None else self.tp.all_max(values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_shard is None:
            return self.matmul(x, self.bias)
        if not self.reduce_results:
            return self.matmul(x, None)
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
        return [self.o_shard(head_dim), kv, kv]

    def o_shard(self, head_dim: int) -> tuple[int, int]:
        """(first column, columns) of the output projection's input: this rank's q heads."""
        return self.q_start * head_dim, self.q * head_dim


def balanced_split(total: int, ranks: int, rank: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s share of ``total`` units: an even split where ``ranks``
    divides ``total``, else the first ``total % ranks`` ranks take one unit more."""
    base, extra = divmod(total, ranks)
    return rank * base + min(rank, extra), base + (rank < extra)


def attention_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> AttentionHeads:
    """The rule: with at least as many kv heads as ranks each rank takes a contiguous group of
    kv heads (:func:`balanced_split`: even where they divide, else the first ranks one more)
    and the q heads that read them, so rank 0 always holds the most heads (the KV budget is
    sized from rank 0's blocks, and its weights are the largest). With fewer kv heads than
    ranks, the q heads split evenly and each kv head is replicated on the ranks of its q heads."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
        )
    if num_kv_heads >= tp.size:
        group = num_heads // num_kv_heads
        kv_start, kv = balanced_split(num_kv_heads, tp.size, tp.rank)
        return AttentionHeads(kv_start * group, kv * group, kv_start, kv)
    if tp.size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size: {tp.size} ranks cannot share {num_kv_heads} kv heads "
            "(replicating them needs ranks to be a multiple of the kv heads)"
        )
    q_start, q = tp.split(num_heads, "num_attention_heads")
    return AttentionHeads(q_start, q, tp.rank * num_kv_heads // tp.size, 1)
