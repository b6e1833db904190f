"""AWQ's and GPTQ's tensors for one projection -> the group-affine form the kernels run.

Both store unsigned ``bits``-bit values ``q`` packed into int32 words, value ``j`` of a word at
bits ``j·bits``, with a scale ``s`` and an integer zero point ``z`` per (group of inputs, output):
``w = (q − z) · s``, which is :class:`~engine.layers.group_affine.AffineWeight`'s
``q · scale + offset`` with ``offset = −z · s``.

* AWQ (GEMM): ``qweight`` [K, N/8] packs along the outputs in the interleaved order
  [0, 2, 4, 6, 1, 3, 5, 7] (word nibble ``i`` holds output ``8c + AWQ_ORDER[i]``), ``qzeros``
  [K/group, N/8] the same way, ``scales`` [K/group, N].
* GPTQ: ``qweight`` [K/(32/bits), N] packs along the inputs in order, ``qzeros``
  [K/group, N/(32/bits)] along the outputs, ``scales`` [K/group, N], ``g_idx`` [K] the group of
  each input. v1 checkpoints store ``z − 1`` (``zero_bias``). With act-order (``desc_act``)
  ``g_idx`` is not ``i // group``: the inputs are reordered here so that each group is
  contiguous, and the caller reorders the activations the same way (:class:`Shard`'s
  ``input_order``) — the kernel then runs the weight as it runs any other.

Under tensor parallelism each tensor is a rank's part (:mod:`engine_quant_awq_gptq.sharding`):
cut along its packed and grouped dims in whole words and groups, except GPTQ's scales and zero
points on a row-parallel layer, which every rank holds whole (its ``g_idx`` part names the
groups its inputs fall in).
"""

from __future__ import annotations

import attrs
import torch

from engine.layers.group_affine import AffineWeight
from engine_quant_awq_gptq.config import PackedIntConfig

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word nibble i holds output AWQ_ORDER[i] of its eight
AWQ_UNDO = tuple(AWQ_ORDER.index(column) for column in range(8))  # output j sits in nibble AWQ_UNDO[j]


@attrs.frozen
class Shard:
    """One projection: its weight with contiguous groups, and the input order that weight
    expects (``x[:, input_order]``; None: the natural order)."""

    weight: AffineWeight
    input_order: torch.Tensor | None = None

    def dequantize_in_input_order(self) -> torch.Tensor:
        """The weight [N, K] in float32 with its columns back in the checkpoint's input order."""
        w = self.weight.dequantize()
        if self.input_order is None:
            return w
        natural = torch.empty_like(w)
        natural[:, self.input_order] = w
        return natural


def unpack_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., C] -> int32 [..., C, 32 // bits]: value ``j`` of each word, from bit ``j·bits``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return (packed.to(torch.int32)[..., None] >> shifts) & (2**bits - 1)


def _expect(method: str, name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"quantization: {method} {name} has shape {tuple(tensor.shape)}, the layer expects {shape}"
        )


def _affine(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int, bits: int
) -> AffineWeight:
    """q [N, K], integer zeros [N, K/group], scales [N, K/group] -> w = (q − z) · s."""
    scale = scales.float()
    return AffineWeight(q.to(torch.uint8).contiguous(), scale, -zeros.float() * scale, group, bits)


def awq_shard(tensors: dict, config: PackedIntConfig, rows: int, inputs: int, group: int) -> Shard:
    """``qweight``, ``qzeros``, ``scales`` of an AWQ GEMM projection [rows, inputs]."""
    groups, words = inputs // group, rows // 8
    _expect("awq", "qweight", tensors["qweight"], (inputs, words))
    _expect("awq", "qzeros", tensors["qzeros"], (groups, words))
    _expect("awq", "scales", tensors["scales"], (groups, rows))
    undo = list(AWQ_UNDO)
    q = unpack_words(tensors["qweight"], 4)[..., undo].reshape(inputs, rows).t()
    zeros = unpack_words(tensors["qzeros"], 4)[..., undo].reshape(groups, rows).t()
    return Shard(_affine(q, zeros, tensors["scales"].t(), group, config.bits))


def gptq_shard(
    tensors: dict, config: PackedIntConfig, rows: int, inputs: int, group: int, stored_groups: int
) -> Shard:
    """``qweight``, ``qzeros``, ``scales``, ``g_idx`` of a GPTQ projection [rows, inputs], whose
    scales and zero points hold ``stored_groups`` groups: ``inputs // group``, or — on a
    row-parallel rank, which holds them whole, as vLLM does — the whole layer's. The groups the
    rank's inputs hold are then picked out; where act-order leaves only part of some group here,
    each input takes its own group's scale and zero point (a group of one: no packed kernel
    holds it, so it is dequantized at load)."""
    bits, per_word = config.bits, 32 // config.bits
    _expect("gptq", "qweight", tensors["qweight"], (inputs // per_word, rows))
    _expect("gptq", "qzeros", tensors["qzeros"], (stored_groups, rows // per_word))
    _expect("gptq", "scales", tensors["scales"], (stored_groups, rows))
    _expect("gptq", "g_idx", tensors["g_idx"], (inputs,))
    q = unpack_words(tensors["qweight"].t(), bits).reshape(rows, inputs)
    zeros = unpack_words(tensors["qzeros"], bits).reshape(stored_groups, rows).t() + config.zero_bias
    scales, g_idx = tensors["scales"].t(), tensors["g_idx"].long()
    held = held_groups(g_idx, group, stored_groups)
    if held is None:
        return Shard(_affine(q, zeros[:, g_idx], scales[:, g_idx], 1, bits))
    order = contiguous_group_order(torch.searchsorted(held, g_idx), group)
    if order is not None:
        q = q[:, order]
    return Shard(_affine(q, zeros[:, held], scales[:, held], group, bits), order)


def held_groups(g_idx: torch.Tensor, group: int, stored_groups: int) -> torch.Tensor | None:
    """The groups ``g_idx`` puts inputs in, ascending, when each holds ``group`` of them; None
    when some hold fewer, which only a row-parallel rank's act-order part may (the whole layer's
    ``g_idx`` must fill every group)."""
    inputs = g_idx.shape[0]
    if inputs and (int(g_idx.min()) < 0 or int(g_idx.max()) >= stored_groups):
        raise ValueError(f"quantization: gptq g_idx names groups outside the {stored_groups} stored")
    groups, counts = torch.unique(g_idx, return_counts=True)
    if bool((counts == group).all()):
        return groups
    if stored_groups * group == inputs:
        raise ValueError(
            f"quantization: gptq g_idx does not put {group} inputs in each of {inputs // group} groups"
        )
    return None


def contiguous_group_order(g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """The input order that makes act-order groups contiguous (None: they already are);
    ``g_idx`` puts ``group`` inputs in each of its groups (:func:`held_groups`)."""
    natural = torch.arange(g_idx.shape[0]) // group
    if torch.equal(g_idx, natural):
        return None
    return torch.argsort(g_idx, stable=True)
