"""A bitsandbytes layer's saved tensors, read by the format's own arithmetic.

4-bit (``Linear4bit``): ``weight`` holds two 4-bit codes a byte, the first in the high nibble,
over the flattened [out, in] weight; value = ``quant_map[code] · absmax[block]`` with one absmax
per ``blocksize`` values. With double quantization the absmaxes are themselves 8-bit codes:
``absmax = nested_quant_map[code] · nested_absmax[nested block] + nested_offset``. The shape,
block sizes and offset travel in a JSON blob (``weight.quant_state.bitsandbytes__nf4``).

8-bit (``Linear8bitLt``, LLM.int8's checkpoint): ``weight`` int8 [out, in] and ``SCB``, each row's
absolute maximum: value = ``weight · SCB / 127``.
"""

from __future__ import annotations

import json

import torch

FOUR_BIT_TENSORS = ("weight", "weight_absmax", "weight_quant_map", "weight_quant_state")
NESTED_TENSORS = ("weight_nested_absmax", "weight_nested_quant_map")
ROW_FORMAT = 0  # weight_format: bitsandbytes' "row" layout, the only one saved to disk


def tensor_name(name: str) -> str:
    """``…q_proj.weight.absmax`` -> ``…q_proj.weight_absmax`` and
    ``…q_proj.weight.quant_state.bitsandbytes__nf4`` -> ``…q_proj.weight_quant_state``: the
    tensors saved below a weight's name, as parameters of its layer."""
    head, sep, tail = name.rpartition(".weight.")
    return f"{head}.weight_{tail.split('.')[0]}" if sep else name


def four_bit_state(tensors: dict) -> dict:
    return json.loads(bytes(tensors["weight_quant_state"].tolist()).decode())


def dequantize_4bit(tensors: dict, rows: int, inputs: int, quant_type: str) -> torch.Tensor:
    """One projection's 4-bit tensors as its float32 weight [rows, inputs]."""
    state = four_bit_state(tensors)
    if list(state["shape"]) != [rows, inputs] or state["quant_type"] != quant_type:
        raise ValueError(
            f"quantization: a bitsandbytes layer saved as {state['quant_type']} {state['shape']} "
            f"where the model has a {quant_type} [{rows}, {inputs}] projection"
        )
    packed = tensors["weight"].reshape(-1)
    codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[: rows * inputs]
    absmax = _absmax(tensors, state)
    scales = absmax.repeat_interleave(state["blocksize"])[: rows * inputs]
    return (tensors["weight_quant_map"].float()[codes.long()] * scales).reshape(rows, inputs)


def _absmax(tensors: dict, state: dict) -> torch.Tensor:
    absmax = tensors["weight_absmax"]
    if "nested_blocksize" not in state:
        return absmax.float()
    missing = [name for name in NESTED_TENSORS if name not in tensors]
    if missing:
        raise ValueError(f"quantization: a double-quantized bitsandbytes layer lacks {missing}")
    nested = tensors["weight_nested_absmax"].float().repeat_interleave(state["nested_blocksize"])
    table = tensors["weight_nested_quant_map"].float()
    return table[absmax.long()] * nested[: absmax.numel()] + state["nested_offset"]


def int8_rows(tensors: dict, rows: int, inputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's 8-bit tensors as (int8 weight [rows, inputs], per-row scale [rows])."""
    weight_format = tensors.get("weight_format")
    if weight_format is not None and int(weight_format) != ROW_FORMAT:
        raise ValueError(
            f"quantization: bitsandbytes weight_format {int(weight_format)} is a GPU tile layout; "
            "only the row layout (0) is read"
        )
    q = tensors["weight"]
    if q.dtype != torch.int8 or tuple(q.shape) != (rows, inputs):
        raise ValueError(
            f"quantization: a bitsandbytes 8-bit layer saved as {q.dtype} {tuple(q.shape)} where "
            f"the model has an int8 [{rows}, {inputs}] projection"
        )
    return q, tensors["SCB"].float() / 127
