"""One projection's compressed-tensors tensors -> the forms the engine's kernels run.

* ``pack-quantized`` (compressed-tensors' ``pack_to_int32``): signed ``bits``-bit values
  ``q`` stored as ``q + 2^(bits−1)``, densely packed along the inputs — value ``i`` of a row at
  bit ``i·bits`` of the row's int32 words, so for 4 and 8 bits word ``c`` holds values
  ``c·32/bits …``, the lowest first; ``weight_scale`` [N, K/group] (group) or [N, 1]
  (channel); asymmetric weights add ``weight_zero_point``, signed values packed the same way
  along the *outputs* [N·bits/32, K/group]; ``weight_shape`` [N, K]. ``w = (q − z) · s``.
* ``int-quantized``: ``weight`` int8 [N, K] as it is, ``weight_scale`` per tensor, row or group.
* ``nvfp4-pack-quantized``: ``weight_packed`` uint8 [N, K/2], two e2m1 codes a byte (the even
  element in the low nibble), ``weight_scale`` float8_e4m3 [N, K/16], ``weight_global_scale``
  float32 [1]: ``w = e2m1 · weight_scale / weight_global_scale``.

The integer formats become :class:`~engine.layers.group_affine.AffineWeight` (``q · scale +
offset`` with an unsigned ``q``): a packed value's unsigned storage ``u = q + 2^(bits−1)`` is that
``q`` with offset ``−(z + 2^(bits−1)) · s``. NVFP4 becomes :class:`~engine.layers.fp4.Fp4Weight`,
its codes as stored and one float32 scale per 16 (``weight_scale / weight_global_scale``, as the
reference divides them): an e4m3 scale is no power of two, so the block does not fold into an
integer weight without error.
"""

from __future__ import annotations

import torch

from engine.layers.fp4 import Fp4Weight
from engine.layers.group_affine import AffineWeight
from engine_quant_awq_gptq.formats import unpack_words
from engine_quant_compressed_tensors.config import NVFP4_GROUP, Scheme, Weights


def _expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"quantization: compressed-tensors {name} has shape {tuple(tensor.shape)}, "
            f"the layer expects {shape}"
        )


def scale_groups(weights: Weights, inputs: int, where: str = "") -> int:
    """How many scales a row holds (refusing a group size that does not divide the inputs;
    ``where`` says whose inputs they are, e.g. a tensor-parallel rank's)."""
    if weights.strategy in ("group", "tensor_group"):
        if inputs % weights.group:
            raise ValueError(
                f"quantization: compressed-tensors group_size {weights.group} does not divide "
                f"a layer's input size {inputs}{where}"
            )
        return inputs // weights.group
    return 1


def _row_scales(scale: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    """A checkpoint's per-tensor, per-row or per-group scale as float32 [rows, groups]."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, groups).contiguous()
    _expect("weight_scale", scale, (rows, groups))
    return scale


def check_weight_shape(tensors: dict, shape: tuple[int, int]) -> None:
    """``pack-quantized``'s ``weight_shape``: the whole projection's [N, K] (``shape``), of
    which a tensor-parallel rank's other tensors are a part."""
    _expect("weight_shape", tensors["weight_shape"], (2,))
    if tuple(tensors["weight_shape"].tolist()) != shape:
        raise ValueError(
            f"quantization: compressed-tensors weight_shape {tensors['weight_shape'].tolist()} "
            f"is not the layer's {list(shape)}"
        )


def packed_int(tensors: dict, weights: Weights, rows: int, inputs: int) -> AffineWeight:
    """``pack-quantized``: ``weight_packed``, ``weight_scale`` and, for asymmetric weights,
    ``weight_zero_point`` (``weight_shape``: :func:`check_weight_shape`)."""
    bits, per_word, groups = weights.bits, 32 // weights.bits, scale_groups(weights, inputs)
    _expect("weight_packed", tensors["weight_packed"], (rows, inputs // per_word))
    u = unpack_words(tensors["weight_packed"], bits).reshape(rows, inputs)
    scale = _row_scales(tensors["weight_scale"], rows, groups)
    zero = torch.zeros(rows, groups)
    if not weights.symmetric:
        _expect("weight_zero_point", tensors["weight_zero_point"], (rows // per_word, groups))
        stored = unpack_words(tensors["weight_zero_point"].t(), bits).reshape(groups, rows).t()
        zero = (stored - 2 ** (bits - 1)).float()
    offset = -(zero + 2 ** (bits - 1)) * scale
    return AffineWeight(u.to(torch.uint8), scale, offset, inputs // groups, bits)


def int8_values(tensors: dict, weights: Weights, rows: int, inputs: int) -> AffineWeight:
    """``int-quantized``: ``weight`` int8 and ``weight_scale``."""
    q = tensors["weight"]
    if q.dtype != torch.int8:
        raise ValueError(f"quantization: compressed-tensors int-quantized weight is {q.dtype}, expected int8")
    _expect("weight", q, (rows, inputs))
    groups = scale_groups(weights, inputs)
    scale = _row_scales(tensors["weight_scale"], rows, groups)
    return AffineWeight((q.to(torch.int16) + 128).to(torch.uint8), scale, -128 * scale, inputs // groups, 8)


def nvfp4(tensors: dict, weights: Weights, rows: int, inputs: int) -> Fp4Weight:
    """``nvfp4-pack-quantized``: ``weight_packed``, ``weight_scale``, ``weight_global_scale``."""
    packed, groups = tensors["weight_packed"], scale_groups(weights, inputs)
    _expect("weight_packed", packed, (rows, inputs // 2))
    global_scale = tensors["weight_global_scale"].float()
    _expect("weight_global_scale", global_scale.reshape(-1), (1,))
    scale = _row_scales(tensors["weight_scale"], rows, groups) / global_scale.reshape(())
    return Fp4Weight(packed.contiguous(), scale, NVFP4_GROUP)


def zero_tensors(scheme: Scheme, rows: int, inputs: int) -> dict:
    """A projection's tensors as ``scheme`` stores them, all zero weights with unit scales: what
    the start-up plan builds a layer's kernel on (``planned_kernel``) to count its bytes."""
    weights, groups = scheme.weights, scale_groups(scheme.weights, inputs)
    inputs_scale = {"static": "input_scale", "nvfp4": "input_global_scale"}  # per-token: none stored
    extra = inputs_scale.get(getattr(scheme.activations, "scales", ""))
    tensors = {} if extra is None else {extra: torch.ones(1)}
    if scheme.format == "pack-quantized":
        tensors |= {
            "weight_packed": torch.zeros(rows, inputs * weights.bits // 32, dtype=torch.int32),
            "weight_scale": torch.ones(rows, groups),
            "weight_shape": torch.tensor([rows, inputs]),
        }
        if not weights.symmetric:
            tensors["weight_zero_point"] = torch.zeros(rows * weights.bits // 32, groups, dtype=torch.int32)
    elif scheme.format == "nvfp4-pack-quantized":
        tensors |= {
            "weight_packed": torch.zeros(rows, inputs // 2, dtype=torch.uint8),
            "weight_scale": torch.ones(rows, groups).to(torch.float8_e4m3fn),
            "weight_global_scale": torch.ones(1),
        }
    elif scheme.format == "float-quantized":
        shape = {"tensor": (1,), "channel": (rows, 1)}.get(weights.strategy)
        if weights.block is not None:
            shape = (-(-rows // weights.block[0]), -(-inputs // weights.block[1]))
        weight = torch.zeros(rows, inputs).to(torch.float8_e4m3fn)
        tensors |= {"weight": weight, "weight_scale": torch.ones(shape or (rows, 1))}
    else:  # int-quantized
        tensors |= {
            "weight": torch.zeros(rows, inputs, dtype=torch.int8),
            "weight_scale": torch.ones(rows, groups),
        }
    return tensors
