"""The ``bitsandbytes`` quant method: checkpoints transformers saved with a
``BitsAndBytesConfig`` (``quantization_config.quant_method: bitsandbytes``).

- 8-bit (LLM.int8's checkpoint: int8 rows and each row's absmax) runs on the core's int8 rows
  (``torch._weight_int8pack_mm``): weight-only, activations stay in their dtype, so no outlier
  decomposition is needed (bitsandbytes' own CPU matmul rounds activations to int8 and keeps
  outlier columns in float16; weight-only is the more exact of the two).
- 4-bit NF4 and FP4 codes index a table of 16 non-uniform values, which no group-affine
  (``scale · q + offset``) kernel holds: they are dequantized at load to the activation dtype and
  run on the platform's dense matmul, a quarter of the checkpoint's memory saving given up.

A layer's shards (q/k/v, gate/up) are collected as they load and joined once all are in; a
module the checkpoint left unquantized (``llm_int8_skip_modules``, the LM head) arrives as a float
``weight`` and is kept. Vocabulary tables and mixture-of-experts layers stay in the activation
dtype (bitsandbytes leaves them unquantized). Tensor parallelism is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.interfaces import QuantMethod
from engine.layers import Layer
from engine.layers.int8 import Int8Rows
from engine_quant_bitsandbytes.config import storage_mode
from engine_quant_bitsandbytes.formats import (
    FOUR_BIT_TENSORS,
    NESTED_TENSORS,
    dequantize_4bit,
    int8_rows,
    tensor_name,
)

SHARD_TENSORS = (*FOUR_BIT_TENSORS, *NESTED_TENSORS, "SCB", "weight_format")


class BitsAndBytesLinearMethod(QuantMethod):
    name = "bitsandbytes"

    def __init__(self, ctx):
        super().__init__(ctx)
        if ctx.quant_config is None:
            raise ValueError(
                "quantization: bitsandbytes reads bitsandbytes checkpoints; it does not quantize online"
            )
        self.mode = storage_mode(ctx.quant_config)

    @classmethod
    def describe(cls, platform) -> str:
        return (
            "8-bit: torch._weight_int8pack_mm (weight-only, per-row scales); 4-bit NF4/FP4: "
            "dequantized at load to the activation dtype (table codes fit no group-affine kernel)"
        )

    def checkpoint_tensor_name(self, name: str) -> str:
        return tensor_name(name)

    def create_weights(self, layer, input_size, output_sizes):
        shards: list[dict] = [dict() for _ in output_sizes]
        for name in SHARD_TENSORS:
            setattr(layer, name, ShardSink(shards, name))
        layer.bnb_shards = shards

    def planned_kernel(self, input_size, output_sizes):
        """What a layer of these sizes holds once loaded, on a zero weight: int8 rows (8-bit) or
        the weight dequantized to the activation dtype (4-bit)."""
        ops, rows = self.ctx.platform.layer_ops(self.ctx.dtype), sum(output_sizes)
        if self.mode == "int8":
            q = torch.zeros(rows, input_size, dtype=torch.int8)
            return Int8Rows(q, torch.ones(rows), self.ctx.dtype, ops)
        return DenseWeight(torch.zeros(rows, input_size, dtype=self.ctx.dtype), ops)

    def process_weights_after_loading(self, layer):
        parts = layer.bnb_shards
        for name in (*SHARD_TENSORS, "bnb_shards"):
            delattr(layer, name)
        rows, inputs = layer.output_sizes, layer.input_size
        kinds = [self._kind(part, index) for index, part in enumerate(parts)]
        ops = self.ctx.platform.layer_ops(self.ctx.dtype)
        if all(kind == "int8" for kind in kinds):
            q, scales = zip(*(int8_rows(part, n, inputs) for part, n in zip(parts, rows)))
            layer.kernel = Int8Rows(torch.cat(q), torch.cat(scales), self.ctx.dtype, ops)
        else:
            dense = torch.cat(
                [self._float(part, kind, n, inputs) for part, kind, n in zip(parts, kinds, rows)]
            )
            layer.kernel = DenseWeight(dense.to(self.ctx.dtype), ops)

    def _kind(self, part: dict, index: int) -> str:
        """ "int8", "4bit" or "float": what the checkpoint holds for this shard."""
        if "SCB" in part:
            return "int8"
        if "weight_quant_state" in part:
            missing = [name for name in FOUR_BIT_TENSORS if name not in part]
            if missing:
                raise ValueError(f"quantization: bitsandbytes shard {index} of a layer lacks {missing}")
            return "4bit"
        weight = part.get("weight")
        if weight is None or not weight.is_floating_point():
            raise ValueError(
                f"quantization: bitsandbytes shard {index} of a layer has neither SCB, a quant_state "
                "nor a float weight"
            )
        return "float"

    def _float(self, part: dict, kind: str, rows: int, inputs: int) -> torch.Tensor:
        if kind == "4bit":
            return dequantize_4bit(part, rows, inputs, self.mode)
        if kind == "int8":
            q, scale = int8_rows(part, rows, inputs)
            return q.float() * scale[:, None]
        return part["weight"].float()

    def apply(self, layer, x, bias):
        out = layer.kernel(x)
        return out if bias is None else out + bias

    def dequantize(self, layer):
        return layer.kernel.dequantize().to(self.ctx.dtype)


class DenseWeight(Layer):
    """A weight dequantized at load, on the platform's prepacked matmul where it has one."""

    def __init__(self, weight: torch.Tensor, ops):
        super().__init__()
        self.packed = ops.pack_dense(weight)
        self.register_buffer("weight", weight if self.packed is None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) if self.packed is None else self.packed(x, None)

    def dequantize(self) -> torch.Tensor:
        return self.weight if self.packed is None else self.packed.dequantize()


class ShardSink:
    """Where ``Linear.load_shard`` hands the shards of one checkpoint tensor name: not a
    parameter, since which tensors a layer's checkpoint holds (4-bit, 8-bit or a float weight
    it left unquantized) is known only once loaded; the method checks them."""

    def __init__(self, shards: list[dict], name: str):
        self.shards, self.name = shards, name

    def weight_loader(self, param, tensor, shard: int) -> None:
        self.shards[shard][self.name] = tensor
