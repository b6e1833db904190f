"""The ``gguf`` quant method: GGUF weights kept quantized in memory.

Per layer, once its shards are loaded (``GGUFBlocks`` from the loader, or float tensors for
F32/F16 tensors and for heads from other files, e.g. EAGLE):

* linear layers and vocabulary tables whose blocks have 32-element groups (Q4_0, Q4_1, Q4_K,
  Q5_0, Q5_1, Q5_K, Q8_0) go to the platform's packed kernel when it has one
  (``LayerOps.pack_affine``; cpu-native: int8 activations × 4/8-bit weights on VNNI, 2.5–5×
  the int4pack planes and faster than bf16, exact lookups from the same bytes);
* otherwise they run on the CPU's int4 matmul, one 4-bit plane per 4 bits — exact up to
  rounding the block scales to the activation dtype;
* other formats (Q6_K's 16-element groups) and other devices keep the blocks as affine
  integers and dequantize them per step (the reference path);
* vocabulary tables (embedding, LM head) stay exact too: one set of int4 planes serves the
  LM-head matmul and, unpacked row by row, the embedding lookups (where torch's packed
  layout is verified readable; else the blocks are kept for lookups and planes packed on
  first LM-head use). A per-row int8 copy was measured and dropped: it cost a quarter of greedy agreement.

Mixture-of-experts layers: each expert's projection (its shards, e.g. gate and up) gets the
kernel a linear layer of the same blocks would, and runs over the rows routed to it.

Tensor parallelism: a rank receives only its part of each tensor's blocks (a row range for
column-parallel and vocabulary layers, a range of whole blocks along every row for
row-parallel ones: the loader refuses a split inside a block) and builds its kernel from
that part alone. The packed kernel rounds activations per row and per 32 inputs, so a
row-parallel rank's input columns, split on a block boundary, are rounded in the same groups
as at one rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.interfaces import QuantMethod
from engine.layers import Layer, VocabEmbedding
from engine.layers.batch_invariant import in_row_buckets, invariant_packing, takes_whole
from engine.layers.group_affine import AffineWeight, Int4Planes, int4pack_unavailable, packed_rows_readable
from engine_quant_gguf.formats import GGUFBlocks


class GGUFLinearMethod(QuantMethod):
    name = "gguf"
    quantizes_embeddings = True
    quantizes_experts = True
    shards_for_tensor_parallel = True  # the placeholder's dims: the loader's slices cut the blocks
    greedy_batch_invariant = True  # apply_greedy checks that apply_batch_invariant takes the call whole

    @classmethod
    def describe(cls, platform) -> str:
        if platform.device_type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu"):
            return (
                "32-group formats on the platform's packed kernel or int4pack planes, "
                "Q6_K dequantized per step"
            )
        return "dequantize per step (int4pack planes are a CPU kernel)"

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        shards: list = [None] * len(output_sizes)
        placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        placeholder.weight_loader = lambda param, tensor, shard: shards.__setitem__(shard, tensor)
        placeholder.output_dim, placeholder.input_dim = 0, 1  # of the checkpoint's [out, in] weight
        layer.register_parameter("weight", placeholder)
        layer.gguf_shards = shards

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shards = layer.gguf_shards
        if any(s is None for s in shards):
            raise ValueError(
                f"{type(layer).__name__}: GGUF shards {[i for i, s in enumerate(shards) if s is None]} "
                "were never loaded"
            )
        del layer.weight, layer.gguf_shards
        vocab = isinstance(layer, VocabEmbedding)
        if vocab:  # a tensor-parallel rank's vocabulary rows; the last rank's padded with zero rows
            shards = [_padded(s, rows) for s, rows in zip(shards, layer.output_sizes)]
        layer.kernel = self._kernel(shards, vocab, layer.output_sizes, layer.input_size)

    def _kernel(self, shards, vocab: bool, output_sizes, input_size: int | None = None) -> nn.Module:
        """One kernel for the fused layer when its shards share a block layout, else one per
        shard with the outputs concatenated (e.g. a Q6_K v_proj beside Q4_K q/k)."""
        for shard, rows in zip(shards, output_sizes):
            if shard.shape[0] != rows or input_size not in (None, shard.shape[1]):
                raise ValueError(
                    f"GGUF tensor part is {tuple(shard.shape)}, the layer expects ({rows}, {input_size})"
                )
        kinds = {(s.qtype if isinstance(s, GGUFBlocks) else "float") for s in shards}
        if len(kinds) > 1:
            return Stacked(
                [self._kernel([s], vocab, [rows], input_size) for s, rows in zip(shards, output_sizes)]
            )
        dtype = self.ctx.dtype
        if kinds == {"float"}:
            return Dense(torch.cat([s.to(dtype) for s in shards]))
        ops, invariant = self.ctx.platform.layer_ops(dtype), self.ctx.batch_invariant
        packed = ops.pack_affine_blocks([s.raw for s in shards], f"ggml:{shards[0].qtype.name.lower()}")
        if packed is not None:  # packed from the file's bytes: no unpacked copy on the way
            return _as_head(invariant_packing(packed, invariant), vocab)
        weight = AffineWeight.cat([s.affine() for s in shards])
        packed = ops.pack_affine(weight)
        if packed is not None:
            return _as_head(invariant_packing(packed, invariant), vocab)
        fast = not int4pack_unavailable(weight, self.ctx.platform.device)
        if vocab and not (fast and packed_rows_readable()):
            return VocabTable(weight, dtype, self.ctx.platform.device)
        if fast:
            return Int4Planes(weight, dtype)
        return AffineReference(weight, dtype)

    def apply(self, layer, x, bias):
        out = layer.kernel(x)
        return out if bias is None else out + bias

    def kernel_of(self, layer):
        return layer.kernel

    def apply_greedy(self, layer, x):
        """The kernel's greedy tokens; under ``--batch-invariant`` only for a call that
        ``apply_batch_invariant`` makes whole (:func:`~engine.layers.batch_invariant.takes_whole`),
        whose logits they are."""
        greedy = getattr(layer.kernel, "greedy", None)
        if greedy is None or (self.ctx.batch_invariant and not takes_whole(layer.kernel, x.shape[0])):
            return None
        return greedy(x)

    def apply_batch_invariant(self, layer, x, bias):
        """A kernel that declares ``invariant_rows`` (:meth:`engine.layers.ops.LayerOps.pack_affine`:
        the packed kernel, any number of rows off AMX tiles) runs as ``apply``, in calls of at
        most that many rows; others in calls padded to probed row buckets (both
        :func:`~engine.layers.batch_invariant.in_row_buckets`)."""
        kernel = layer.kernel
        key = ("gguf", type(kernel).__name__, layer.input_size, sum(layer.output_sizes), self.ctx.dtype)
        return in_row_buckets(lambda rows: self.apply(layer, rows, bias), x, (*key, bias is not None), kernel)

    def create_moe_weights(
        self, layer: nn.Module, num_experts: int, input_size: int, output_sizes: list[int]
    ) -> None:
        shards = [[None] * len(output_sizes) for _ in range(num_experts)]
        placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        placeholder.expert_weight_loader = lambda param, tensor, expert, shard: shards[expert].__setitem__(
            shard, tensor
        )
        layer.register_parameter("weight", placeholder)
        layer.gguf_expert_shards = shards

    def process_moe_weights_after_loading(self, layer: nn.Module) -> None:
        shards = layer.gguf_expert_shards
        del layer.weight, layer.gguf_expert_shards
        layer.experts = nn.ModuleList(self._kernel(expert, False, layer.output_sizes) for expert in shards)

    def apply_moe(self, layer, x, segments):
        experts = layer.experts
        return segments.per_expert(x, sum(layer.output_sizes), lambda e, rows: experts[e](rows))

    def dequantize_moe(self, layer) -> torch.Tensor:
        return torch.stack([expert.dequantize() for expert in layer.experts]).to(self.ctx.dtype)

    def dequantize(self, layer) -> torch.Tensor:
        return layer.kernel.dequantize().to(self.ctx.dtype)

    def embed(self, layer, input_ids):
        return layer.kernel.rows(input_ids).to(self.ctx.dtype)


def _as_head(packed: nn.Module, vocab: bool) -> nn.Module:
    """``packed``, or for a vocabulary table (``vocab``) whose packing offers ``logits``
    (``LayerOps.pack_affine``: activations rounded finer, float32 out) the table whose matmul
    gives the LM head's logits through it."""
    return VocabLogits(packed) if vocab and callable(getattr(packed, "logits", None)) else packed


class VocabLogits(Layer):
    """A packed vocabulary table: lookups by its ``rows``, the LM head by its ``logits`` (told
    first through ``prepare_logits`` where the packing has one)."""

    def __init__(self, packed: nn.Module):
        super().__init__()
        self.packed = packed
        prepare = getattr(packed, "prepare_logits", None)
        if callable(prepare):
            prepare()

    def forward(self, x):
        return self.packed.logits(x)

    def greedy(self, x):
        """Each row's first maximum of ``forward(x)`` where the packing finds it without the
        logits (``greedy``, :meth:`engine.layers.ops.LayerOps.pack_affine`), else None."""
        greedy = getattr(self.packed, "greedy", None)
        return greedy(x) if greedy is not None else None

    @property
    def invariant_rows(self):
        """The packing's (0 where it declares none)."""
        return getattr(self.packed, "invariant_rows", 0)

    def dequantize(self):
        return self.packed.dequantize()

    def rows(self, ids):
        return self.packed.rows(ids)


def _padded(shard, rows: int):
    """``shard`` (blocks or a float tensor) with zero rows up to ``rows``: zero blocks (scale
    and offset 0) dequantize to zero in every format."""
    missing = rows - shard.shape[0]
    if missing <= 0:
        return shard
    if isinstance(shard, GGUFBlocks):
        return GGUFBlocks(F.pad(shard.raw, (0, 0, 0, missing)), shard.qtype)
    return F.pad(shard, (0, 0, 0, missing))


class Dense(Layer):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.contiguous())

    def forward(self, x):
        return F.linear(x, self.weight)

    def dequantize(self):
        return self.weight

    def rows(self, ids):
        return F.embedding(ids, self.weight)


class AffineBuffers(Layer):
    """An :class:`AffineWeight` whose tensors are registered buffers (counted, moved)."""

    def __init__(self, weight: AffineWeight, dtype: torch.dtype):
        super().__init__()
        self.group, self.bits, self.dtype = weight.group, weight.bits, dtype
        for name in ("q", "scale", "offset"):
            self.register_buffer(name, getattr(weight, name))

    @property
    def weight(self) -> AffineWeight:
        return AffineWeight(self.q, self.scale, self.offset, self.group, self.bits)

    def dequantize(self):
        return self.weight.dequantize(self.dtype)

    def rows(self, ids):
        return self.weight.rows(ids, self.dtype)


class VocabTable(AffineBuffers):
    """Exact rows for lookups; the LM-head kernel is packed when first asked for logits."""

    def __init__(self, weight: AffineWeight, dtype: torch.dtype, device):
        super().__init__(weight, dtype)
        self.device = device
        self.head: nn.Module | None = None

    def forward(self, x):
        if self.head is None:
            fast = not int4pack_unavailable(self.weight, self.device)
            self.head = (
                Int4Planes(self.weight, self.dtype) if fast else AffineReference(self.weight, self.dtype)
            )
        return self.head(x)


class Stacked(Layer):
    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x):
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def dequantize(self):
        return torch.cat([part.dequantize() for part in self.parts])


class AffineReference(AffineBuffers):
    """Blocks kept as affine integers, dequantized for every matmul: the plain reference."""

    def forward(self, x):
        return F.linear(x, self.weight.dequantize(x.dtype))
