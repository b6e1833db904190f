"""The ``compressed-tensors`` quant method: checkpoints whose ``quantization_config.quant_method``
is ``compressed-tensors`` (written by llm-compressor / the compressed-tensors library).

Per layer, the checkpoint's tensors are collected shard by shard (q/k/v and gate/up fused here)
and turned into one kernel, by the checkpoint's scheme (:mod:`engine_quant_compressed_tensors.config`):

* ``pack-quantized`` W4A16 / W8A16 (group or channel, symmetric or not) and weight-only
  ``int-quantized``: a group-affine weight on the kernel AWQ and GPTQ take (the platform's
  packed kernel, else int4pack planes, else dequantized at load);
* ``int-quantized`` W8A8: int8 rows as they are stored, activations rounded per token
  (dynamic; the platform's packed kernel where it has one, as the int8 plugin does) or by the
  checkpoint's per-tensor ``input_scale`` (static);
* ``float-quantized`` FP8: the fp8 plugin's method runs the layer;
* ``nvfp4-pack-quantized`` (NVFP4A16, and W4A4 with its activations rounded to NVFP4 as the
  checkpoint says): e2m1 values with float8 block scales and a global scale, as a group-affine
  weight — its blocks of 16 fit no packed kernel, so it is dequantized at load.

A module the checkpoint leaves unquantized (``ignore``, or not targeted) arrives as a float
``weight`` and stays float. Mixture-of-experts experts and quantized vocabulary tables are
refused by name.

Tensor parallelism: every tensor declares the dims a rank's part is cut along
(:func:`tensor_dims`): weights, packed words and per-row or per-group scales and zero points
along their rows and, where they hold columns, their columns; per-tensor scales (weight,
global, input) are whole on every rank. Each rank builds its kernel from its part alone, with
the checkpoint's own scales, so its values are exactly TP=1's. A split that would cut a
packing word, a scale group or an FP8 block across ranks is refused at start-up, naming it.
"""

from __future__ import annotations

import logging

import torch

from engine.distributed import current_tensor_parallel
from engine.interfaces import QuantMethod
from engine.layers.group_affine import AffineWeight
from engine.layers.parallel import ColumnParallelLinear, RowParallelLinear
from engine_quant_awq_gptq.kernels import dense_kernel, group_affine_kernel, probe_path
from engine_quant_awq_gptq.method import ShardSink
from engine_quant_compressed_tensors import formats
from engine_quant_compressed_tensors.config import Weights, check_ignore, read_ignore, read_scheme
from engine_quant_compressed_tensors.kernels import (
    DynamicInt8,
    Fp8Layer,
    int8_rows,
    nvfp4_activations,
    static_int8,
)

logger = logging.getLogger(__name__)

TENSOR_NAMES = (
    "weight",
    "weight_packed",
    "weight_scale",
    "weight_shape",
    "weight_zero_point",
    "weight_global_scale",
    "input_scale",
    "input_global_scale",
)
REQUIRED = {
    "pack-quantized": ("weight_packed", "weight_scale", "weight_shape"),
    "int-quantized": ("weight", "weight_scale"),
    "float-quantized": ("weight", "weight_scale"),
    "nvfp4-pack-quantized": ("weight_packed", "weight_scale", "weight_global_scale"),
}
PATHS = {
    "packed": "the platform's packed group-affine kernel",
    "int4pack": "int4pack planes (torch's CPU int4 matmul)",
    "dense": "dequantized at load to the activation dtype (no kernel holds it here)",
    "w8a8-packed": "the platform's packed kernel, int8 activations per 32 inputs",
    "w8a8-dynamic": "torch._int_mm, dynamic per-token int8 activations",
    "w8a8-static": "torch._int_mm, the checkpoint's static per-tensor activation scale",
    "fp8": "the fp8 plugin's method",
    "nvfp4-w4a4": "dequantized at load, activations rounded to NVFP4 per 16 inputs as the checkpoint says",
    "float": "the checkpoint's float weight (a module it leaves unquantized)",
}


# weight strategies whose scales (and zero points) hold columns: [N, K/group] or [N/b, K/b]
COLUMN_SCALES = ("group", "tensor_group", "block")


def tensor_dims(name: str, weights: Weights) -> tuple[int | None, int | None]:
    """(output_dim, input_dim) of a checkpoint tensor of a layer: the dims a tensor-parallel
    rank's part is cut along (None: whole on every rank)."""
    if name in ("weight", "weight_packed"):
        return 0, 1
    if name in ("weight_scale", "weight_zero_point") and weights.strategy != "tensor":
        return 0, (1 if weights.strategy in COLUMN_SCALES else None)
    return None, None  # weight_shape, and per-tensor scales: the weight's, global or input


class DimsSink(ShardSink):
    """A :class:`ShardSink` declaring the dims its tensor shards along (:func:`tensor_dims`)."""

    def __init__(self, shards: list[dict], name: str, dims: tuple[int | None, int | None]):
        super().__init__(shards, name)
        self.output_dim, self.input_dim = dims


def split_dims(layer) -> tuple[bool, bool]:
    """Whether ``layer``'s outputs and its inputs are split over tensor-parallel ranks."""
    if current_tensor_parallel().size == 1:
        return False, False
    return isinstance(layer, ColumnParallelLinear), isinstance(layer, RowParallelLinear)


class CompressedTensorsLinearMethod(QuantMethod):
    name = "compressed-tensors"
    shards_for_tensor_parallel = True  # each tensor declares the dims it splits along: tensor_dims

    def __init__(self, ctx):
        super().__init__(ctx)
        if ctx.quant_config is None:
            raise ValueError(
                "quantization: compressed-tensors reads its checkpoints; it does not quantize online"
            )
        self.scheme = read_scheme(ctx.quant_config)
        self.ignore = read_ignore(ctx.quant_config)

    def check_checkpoint_modules(self, modules):
        check_ignore(self.ignore, modules)

    @classmethod
    def describe(cls, platform) -> str:
        return (
            f"pack-quantized and weight-only int: {PATHS[probe_path(platform)]}; int W8A8: torch._int_mm "
            "or the platform's packed kernel; FP8: the fp8 plugin's path; NVFP4: dequantized at load "
            "(W4A4: activations rounded to NVFP4 first)"
        )

    def create_weights(self, layer, input_size, output_sizes):
        self._check_packing(layer, input_size, output_sizes)
        shards: list[dict] = [dict() for _ in output_sizes]
        for name in TENSOR_NAMES:
            setattr(layer, name, DimsSink(shards, name, tensor_dims(name, self.scheme.weights)))
        layer.ct_shards = shards

    def _check_packing(self, layer, input_size: int, output_sizes: list[int]) -> None:
        """Refuse a layer whose sizes the format's words, groups or blocks cannot hold — under
        tensor parallelism, the sizes of this rank's part, so that none straddles two ranks."""
        weights = self.scheme.weights
        outputs_split, inputs_split = split_dims(layer)
        per_rank = " (a tensor-parallel rank's part of a layer)" if outputs_split or inputs_split else ""
        formats.scale_groups(weights, input_size, per_rank)
        if self.scheme.format == "pack-quantized":
            per_word = 32 // weights.bits
            rows = output_sizes if not weights.symmetric else []
            if input_size % per_word or any(size % per_word for size in rows):
                raise ValueError(
                    f"quantization: compressed-tensors packs {per_word} values a word; input size "
                    f"{input_size} or output sizes {output_sizes}{per_rank} do not"
                )
        if weights.block and (outputs_split or inputs_split):
            rows_per_block, columns_per_block = weights.block
            rows_cut = outputs_split and any(size % rows_per_block for size in output_sizes)
            if rows_cut or inputs_split and input_size % columns_per_block:
                raise ValueError(
                    f"quantization: compressed-tensors FP8 blocks of {rows_per_block}x{columns_per_block} "
                    f"would straddle tensor-parallel ranks: a rank holds output sizes {output_sizes} "
                    f"and input size {input_size} of a layer, not whole blocks"
                )

    def process_weights_after_loading(self, layer):
        parts = layer.ct_shards
        for name in (*TENSOR_NAMES, "ct_shards"):
            delattr(layer, name)
        self._check_loaded(parts, layer)
        if any(_is_float(part) for part in parts):
            dense = torch.cat(
                [
                    self._dequantized(part, rows, layer.input_size)
                    for part, rows in zip(parts, layer.output_sizes)
                ]
            )
            layer.kernel, layer.kernel_path = dense_kernel(dense, self.ctx.platform, self.ctx.dtype), "float"
        else:
            layer.kernel, layer.kernel_path = self._kernel(parts, layer.output_sizes, layer.input_size)
        if layer.kernel_path not in ("packed", "w8a8-packed"):
            shape = (sum(layer.output_sizes), layer.input_size)
            logger.info("compressed-tensors: a %s layer runs %s", shape, PATHS[layer.kernel_path])

    def _check_loaded(self, parts: list[dict], layer) -> None:
        required = REQUIRED[self.scheme.format]
        if not self.scheme.weights.symmetric:
            required += ("weight_zero_point",)
        scales = getattr(self.scheme.activations, "scales", None)
        required += {"static": ("input_scale",), "nvfp4": ("input_global_scale",)}.get(scales, ())
        for index, part in enumerate(parts):
            missing = [name for name in required if name not in part]
            if missing and not _is_float(part):
                raise ValueError(
                    f"quantization: compressed-tensors checkpoint lacks {missing} of shard {index} of a layer"
                )
            if "weight_shape" in part:  # the whole projection's, as the checkpoint holds it
                formats.check_weight_shape(part, (layer.full_output_sizes[index], layer.full_input_size))

    def _affine(self, part: dict, rows: int, inputs: int) -> AffineWeight:
        """A shard as a group-affine weight (every format but FP8)."""
        read = {
            "pack-quantized": formats.packed_int,
            "int-quantized": formats.int8_values,
            "nvfp4-pack-quantized": formats.nvfp4,
        }[self.scheme.format]
        return read(part, self.scheme.weights, rows, inputs)

    def _dequantized(self, part: dict, rows: int, inputs: int) -> torch.Tensor:
        """A shard's weight in float32 (for a fused layer of which the checkpoint left part float)."""
        if _is_float(part):
            return part["weight"].float()
        if self.scheme.format == "float-quantized":
            return Fp8Layer(self.ctx, self.scheme.weights.block, [part], [rows]).dequantize().float()
        return self._affine(part, rows, inputs).dequantize()

    def _kernel(self, parts: list[dict], output_sizes: list[int], inputs: int):
        """-> (the module computing x · wᵀ, its path's name)."""
        ctx, scheme = self.ctx, self.scheme
        if scheme.format == "float-quantized":
            return Fp8Layer(ctx, scheme.weights.block, parts, output_sizes), "fp8"
        shards = [self._affine(part, rows, inputs) for part, rows in zip(parts, output_sizes)]
        ops = ctx.platform.layer_ops(ctx.dtype)
        if scheme.activations is None:
            return group_affine_kernel(AffineWeight.cat(shards), ctx.platform, ctx.dtype)
        if scheme.activations.scales == "nvfp4":
            scales = [_scalar(part["input_global_scale"]) for part in parts]
            return nvfp4_activations(list(zip(shards, scales)), ctx.platform, ctx.dtype), "nvfp4-w4a4"
        if scheme.activations.scales == "static":
            scales = [_scalar(part["input_scale"]) for part in parts]
            return static_int8(list(zip(shards, scales)), ctx.dtype, ops), "w8a8-static"
        rows = int8_rows(AffineWeight.cat(shards), ctx.dtype, ops)
        affine = rows.as_affine()
        packed = ops.pack_affine(affine) if affine is not None else None
        return (packed, "w8a8-packed") if packed is not None else (DynamicInt8(rows), "w8a8-dynamic")

    def apply(self, layer, x, bias):
        out = layer.kernel(x)
        return out if bias is None else out + bias

    def dequantize(self, layer):
        return layer.kernel.dequantize().to(self.ctx.dtype)


def _scalar(tensor: torch.Tensor) -> float:
    return float(tensor.float().reshape(-1)[0])


def _is_float(part: dict) -> bool:
    """A shard the checkpoint stores unquantized: a float ``weight`` and nothing packed."""
    weight = part.get("weight")
    return weight is not None and weight.is_floating_point() and weight.element_size() > 1
