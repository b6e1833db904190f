"""AWQ and GPTQ checkpoints written from float weights (tests, benchmarks), and their plain
dequantization: the reference the method is checked against.

Rounding is to nearest with min/max scales (AutoAWQ's ``pseudo_quantize_tensor``, GPTQ's
``Quantizer.find_params``) — GPTQ's error compensation changes which integers are stored, not
how they are stored, and the storage is what a loader reads. Packing follows each format's
published loops: AutoAWQ's ``WQLinear_GEMM.from_linear`` (outputs in the order
[0, 2, 4, 6, 1, 3, 5, 7]) and AutoGPTQ's ``QuantLinear.pack`` (inputs in order, zeros stored
minus one in v1). The dequantizers read the words back value by value, independently of
:mod:`engine_quant_awq_gptq.formats`.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_groups(weight: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool):
    """Round ``weight`` [N, K] to ``bits`` per group (``g_idx`` [K]: each input's group) ->
    (q int32 [N, K], zeros int32 [N, G], float16 scales [N, G]), w ≈ (q − z) · s."""
    w, maxq = weight.float(), 2**bits - 1
    groups = int(g_idx.max()) + 1
    members = [g_idx == g for g in range(groups)]
    low = torch.stack([w[:, m].amin(1) for m in members], 1).clamp(max=0)
    high = torch.stack([w[:, m].amax(1) for m in members], 1).clamp(min=0)
    if sym:
        high = torch.maximum(low.abs(), high)
        low = -high
    scales = ((high - low) / maxq).clamp(min=1e-5).half()
    if sym:
        zeros = torch.full_like(scales, (maxq + 1) // 2, dtype=torch.int32)
    else:
        zeros = (-low / scales.float()).round().clamp(0, maxq).to(torch.int32)
    s, z = scales.float()[:, g_idx], zeros[:, g_idx]
    q = (w / s).round().add(z).clamp(0, maxq).to(torch.int32)
    return q, zeros, scales


def _pack_columns(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """int [R, C] -> int32 [R, C·bits/32]: word ``c`` holds columns c·n … c·n + n − 1, its value
    ``i`` being column ``c·n + order[i]``."""
    per_word = 32 // bits
    order = order or range(per_word)
    packed = torch.zeros(values.shape[0], values.shape[1] // per_word, dtype=torch.int32)
    for col in range(packed.shape[1]):
        for i, source in enumerate(order):
            packed[:, col] |= values[:, col * per_word + source].to(torch.int32) << (i * bits)
    return packed


def awq_tensors(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """``qweight`` [K, N/8], ``qzeros`` [K/group, N/8], ``scales`` [K/group, N] of ``weight`` [N, K]."""
    g_idx = torch.arange(weight.shape[1]) // group
    q, zeros, scales = quantize_groups(weight, 4, g_idx, sym=False)
    return {
        "qweight": _pack_columns(q.t(), 4, AWQ_ORDER),
        "qzeros": _pack_columns(zeros.t(), 4, AWQ_ORDER),
        "scales": scales.t().contiguous(),
    }


def act_order(inputs: int) -> torch.Tensor:
    """A stand-in for the order GPTQ's act-order quantizes the inputs in (by its Hessian of the
    layer's inputs): seeded by the input size, so projections of the same inputs (q/k/v,
    gate/up) share it as they do in real checkpoints."""
    return torch.randperm(inputs, generator=torch.Generator().manual_seed(inputs))


def gptq_tensors(
    weight: torch.Tensor,
    bits: int,
    group: int,
    sym: bool = True,
    desc_act: bool = False,
    v2: bool = False,
    order: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``qweight`` [K·bits/32, N], ``qzeros`` [G, N·bits/32], ``scales`` [G, N], ``g_idx`` [K] of
    ``weight`` [N, K]; with ``desc_act`` the inputs are grouped in ``order`` (default
    :func:`act_order`): input ``order[i]`` falls in group ``i // group``."""
    inputs = weight.shape[1]
    g_idx = torch.arange(inputs) // group
    if desc_act:
        position = torch.empty_like(g_idx)
        position[order if order is not None else act_order(inputs)] = torch.arange(inputs)
        g_idx = position // group
    q, zeros, scales = quantize_groups(weight, bits, g_idx, sym)
    stored_zeros = zeros if v2 else (zeros - 1) & (2**bits - 1)
    return {
        "qweight": _pack_columns(q, bits).t().contiguous(),  # AutoGPTQ packs intweight [K, N] by rows
        "qzeros": _pack_columns(stored_zeros.t(), bits),
        "scales": scales.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def _unpack_columns(packed: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    per_word = 32 // bits
    values = torch.empty(packed.shape[0], packed.shape[1] * per_word, dtype=torch.int64)
    for i, source in enumerate(order or range(per_word)):
        values[:, source::per_word] = (packed.long() >> (i * bits)) & (2**bits - 1)
    return values


def dequantize_awq(tensors: dict, group: int) -> torch.Tensor:
    """w [N, K] = (q − z) · s, float32."""
    q = _unpack_columns(tensors["qweight"], 4, AWQ_ORDER)  # [K, N]
    zeros = _unpack_columns(tensors["qzeros"], 4, AWQ_ORDER).repeat_interleave(group, 0)
    scales = tensors["scales"].float().repeat_interleave(group, 0)
    return ((q - zeros) * scales).t().contiguous()


def dequantize_gptq(tensors: dict, bits: int, v2: bool = False) -> torch.Tensor:
    """w [N, K] = (q − z[g_idx]) · s[g_idx], float32; v1 zeros are stored minus one."""
    q = _unpack_columns(tensors["qweight"].t(), bits).t()  # [K, N]
    zeros = _unpack_columns(tensors["qzeros"], bits) + (0 if v2 else 1)
    g_idx = tensors["g_idx"].long()
    return ((q - zeros[g_idx]) * tensors["scales"].float()[g_idx]).t().contiguous()


def awq_config(group: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}


def gptq_config(bits: int, group: int, sym: bool = True, desc_act: bool = False, v2: bool = False) -> dict:
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
    }
