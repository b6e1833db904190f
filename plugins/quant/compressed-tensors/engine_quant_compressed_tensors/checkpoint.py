"""compressed-tensors checkpoints written from float weights (tests, benchmarks), and their
plain dequantization: the reference the method is checked against.

Written from the library's own code (compressed-tensors 0.20): scales and zero points as
``calculate_qparams`` computes them from a group's min and max (symmetric: ``max|w| /
((qmax − qmin) / 2)``; asymmetric: ``(max − min) / (qmax − qmin)`` and ``z = qmin − min / s``
rounded), values ``round(w / s + z)`` clamped to the signed range (``quantize``), packed by
``pack_to_int32`` (``q + 2^(bits−1)``, value ``i`` of a row at bit ``i·bits``; zero points along
the outputs), NVFP4 as ``NVFP4PackedCompressor`` stores it (global scale ``448 · 6 / max|w|``,
float8 block scales, e2m1 codes two a byte, the even element low). The dequantizers read bits
back by their positions, independently of :mod:`engine_quant_compressed_tensors.formats`.
"""

from __future__ import annotations

import torch

from engine.layers.fp4 import E2M1
from engine_quant_fp8 import checkpoint as fp8_checkpoint

SCALE_DTYPE = torch.bfloat16  # llm-compressor stores scales in the model's dtype
FP8 = torch.float8_e4m3fn


def _groups(weight: torch.Tensor, group: int | None) -> torch.Tensor:
    """[N, K] -> [N, K/group, group] (None: one group per row)."""
    rows, cols = weight.shape
    return weight.float().reshape(rows, -1, group or cols)


def quantize_int(weight: torch.Tensor, bits: int, group: int | None, symmetric: bool):
    """-> (q int8 [N, K] signed, scale [N, G] in :data:`SCALE_DTYPE`, zero int8 [N, G])."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    w = _groups(weight, group)
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    if symmetric:
        scale = torch.maximum(low.abs(), high) / ((qmax - qmin) / 2)
        zero = torch.zeros_like(scale)
    else:
        scale = (high - low) / (qmax - qmin)
        zero = (qmin - low / scale).clamp(qmin, qmax).round()
    scale = scale.to(SCALE_DTYPE)
    scale = torch.where(scale == 0, torch.finfo(SCALE_DTYPE).eps, scale)  # an all-zero group
    q = (w / scale.float()[..., None] + zero[..., None]).round().clamp(qmin, qmax)
    return q.reshape(weight.shape).to(torch.int8), scale, zero.to(torch.int8)


def _bit_offsets(bits: int) -> torch.Tensor:
    """Where each of a word's values starts: value ``i`` of a row at bit ``i·bits`` (4 and 8
    bits: whole values per word, so word ``c`` holds values ``c·32/bits`` on)."""
    return torch.arange(0, 32, bits, dtype=torch.int64)


def pack_to_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 [R, C] -> int32 [R, C·bits/32]: ``v + 2^(bits−1)``, value ``i`` at bit ``i·bits``."""
    rows, cols = values.shape
    unsigned = (values.long() + 2 ** (bits - 1)).reshape(rows, cols * bits // 32, 32 // bits)
    packed = (unsigned << _bit_offsets(bits)).sum(-1)
    return (packed - ((packed >> 31) << 32)).to(torch.int32)  # the words' bits as signed int32


def unpack_from_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    words = packed.long() & 0xFFFFFFFF
    values = (words[..., None] >> _bit_offsets(bits)) & (2**bits - 1)
    return values.reshape(packed.shape[0], -1)[:, :cols] - 2 ** (bits - 1)


def packed_tensors(weight: torch.Tensor, bits: int, group: int | None, symmetric: bool = True) -> dict:
    """``pack-quantized``: ``weight_packed``, ``weight_scale``, ``weight_shape`` (and
    ``weight_zero_point`` when asymmetric) of ``weight`` [N, K]."""
    q, scale, zero = quantize_int(weight, bits, group, symmetric)
    tensors = {
        "weight_packed": pack_to_int32(q, bits),
        "weight_scale": scale,
        "weight_shape": torch.tensor(weight.shape),
    }
    if not symmetric:
        tensors["weight_zero_point"] = pack_to_int32(zero.t(), bits).t().contiguous()
    return tensors


def dequantize_packed(tensors: dict, bits: int) -> torch.Tensor:
    rows, cols = tensors["weight_shape"].tolist()
    q = unpack_from_int32(tensors["weight_packed"], bits, cols)
    scale = tensors["weight_scale"].float()
    zero = torch.zeros_like(scale)
    if "weight_zero_point" in tensors:
        zero = unpack_from_int32(tensors["weight_zero_point"].t(), bits, rows).t().float()
    group = cols // scale.shape[1]
    return (q - zero.repeat_interleave(group, 1)) * scale.repeat_interleave(group, 1)


def int8_tensors(weight: torch.Tensor, input_scale: float | None = None) -> dict:
    """``int-quantized`` per output channel: ``weight`` int8, ``weight_scale`` [N, 1] (and a
    static ``input_scale``)."""
    q, scale, _ = quantize_int(weight, 8, None, True)
    tensors = {"weight": q, "weight_scale": scale}
    return tensors | ({} if input_scale is None else {"input_scale": torch.tensor([input_scale])})


def dequantize_int8(tensors: dict) -> torch.Tensor:
    return tensors["weight"].float() * tensors["weight_scale"].float()


def fp8_tensors(weight: torch.Tensor, strategy: str, block: int = 128) -> dict:
    """``float-quantized``: ``weight`` e4m3 and ``weight_scale`` [1] (tensor), [N, 1] (channel)
    or [N/block, K/block] (block) — the fp8 plugin's writer, named as compressed-tensors names it."""
    tensors = fp8_checkpoint.quantize(weight, strategy, block)
    scale = tensors.pop("weight_scale", None)
    scale = tensors.pop("weight_scale_inv") if scale is None else scale.reshape(-1, 1)[: weight.shape[0]]
    return {"weight": tensors["weight"], "weight_scale": scale.reshape(1) if strategy == "tensor" else scale}


def dequantize_fp8(tensors: dict, strategy: str) -> torch.Tensor:
    name = "weight_scale_inv" if strategy == "block" else "weight_scale"
    return fp8_checkpoint.dequantize({"weight": tensors["weight"], name: tensors["weight_scale"]})


def _nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """The e2m1 code nearest each value of ``x`` (already within ±6)."""
    magnitude = (x.abs()[..., None] - E2M1[:8]).abs().argmin(-1)
    return magnitude | ((x < 0).long() << 3)


def nvfp4_tensors(weight: torch.Tensor, input_global_scale: float | None = None) -> dict:
    """``nvfp4-pack-quantized``: ``weight_packed`` uint8 [N, K/2], ``weight_scale`` e4m3
    [N, K/16], ``weight_global_scale`` [1] (and, for W4A4, a calibrated ``input_global_scale``)."""
    w = _groups(weight, 16)
    global_scale = (448.0 * 6.0 / w.abs().amax()).reshape(1)
    scale = (w.abs().amax(-1) / 6.0 * global_scale).to(FP8)
    scaled = w / (scale.float() / global_scale)[..., None]
    codes = _nearest_e2m1(scaled.clamp(-6, 6)).reshape(weight.shape[0], -1, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    tensors = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": global_scale}
    if input_global_scale is not None:
        tensors["input_global_scale"] = torch.tensor([input_global_scale])
    return tensors


def fake_quantize_nvfp4(x: torch.Tensor, global_scale: float) -> torch.Tensor:
    """Activations as compressed-tensors' forward rounds NVFP4 inputs: per 16 values a float8
    scale ``max|x| / 6 · g`` (0 replaced by 0.125), divided by ``g``; values to the nearest e2m1."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 16)
    scale = (blocks.abs().amax(-1, keepdim=True) / 6 * global_scale).to(FP8).float()
    scale = torch.where(scale == 0, torch.tensor(0.125), scale) / global_scale
    return (E2M1[_nearest_e2m1((blocks / scale).clamp(-6, 6))] * scale).reshape(x.shape).to(x.dtype)


def dequantize_nvfp4(tensors: dict) -> torch.Tensor:
    packed = tensors["weight_packed"].long()
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)
    scale = tensors["weight_scale"].float() / tensors["weight_global_scale"].float()
    return E2M1[codes] * scale.repeat_interleave(16, 1)


def config(fmt: str, weights: dict, activations: dict | None = None, ignore=("lm_head",)) -> dict:
    """A ``quantization_config`` as compressed-tensors writes it, one group over every Linear."""
    return mixed_config({"group_0": group(fmt, weights, activations)}, ignore, fmt)


def group(fmt: str, weights: dict, activations: dict | None = None, targets=("Linear",)) -> dict:
    """One of ``config_groups``: the modules ``targets`` names quantized by the scheme."""
    return {"targets": list(targets), "weights": weights, "input_activations": activations, "format": fmt}


def mixed_config(groups: dict, ignore=("lm_head",), fmt: str = "mixed-precision") -> dict:
    """A ``quantization_config`` of several ``config_groups`` ({name: :func:`group`})."""
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


def int_weights(bits: int, group: int | None, symmetric: bool = True) -> dict:
    strategy = "group" if group else "channel"
    return {
        "num_bits": bits,
        "type": "int",
        "strategy": strategy,
        "group_size": group,
        "symmetric": symmetric,
    }


def float_weights(strategy: str, block: int = 128) -> dict:
    block_structure = [block, block] if strategy == "block" else None
    return {
        "num_bits": 8,
        "type": "float",
        "strategy": strategy,
        "block_structure": block_structure,
        "symmetric": True,
    }


NVFP4_WEIGHTS = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "symmetric": True,
}


NVFP4_ACTIVATIONS = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "dynamic": "local",
    "symmetric": True,
}


def activations(kind: str, dynamic: bool) -> dict:
    strategy = "token" if dynamic else "tensor"
    return {"num_bits": 8, "type": kind, "strategy": strategy, "dynamic": dynamic, "symmetric": True}
