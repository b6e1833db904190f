"""The ``awq`` and ``gptq`` quant methods: checkpoints whose ``quantization_config.quant_method``
is ``awq`` (GEMM packing) or ``gptq`` (4/8-bit, act-order, v1/v2 zero points).

A layer's tensors are collected shard by shard (q/k/v and gate/up are separate projections in
the checkpoint, fused here), unpacked into one group-affine weight
(:mod:`engine_quant_awq_gptq.formats`) and repacked for the fastest kernel that holds it
(:mod:`engine_quant_awq_gptq.kernels`). A fused GPTQ act-order layer whose shards reorder their
inputs differently cannot share one activation order: it is dequantized at load instead (real
checkpoints quantize q/k/v and gate/up from the same inputs, so their orders agree). A module the
checkpoint leaves unquantized (``modules_to_not_convert``) arrives as a float ``weight`` and is kept
as it is.

Vocabulary tables stay in the activation dtype (AWQ and GPTQ checkpoints store them unquantized),
as do mixture-of-experts layers.

Tensor parallelism: every tensor declares the dims a rank's part is cut along (``TENSOR_DIMS``);
each rank builds its kernel from its part alone, with the checkpoint's own scales and zero
points, so its values are exactly TP=1's. A split that would cut a packing word or a scale group
is refused at start-up, naming the rank's sizes (:mod:`engine_quant_awq_gptq.sharding`, shared
with compressed-tensors). GPTQ's scales and zero points are whole on every rank of a
row-parallel layer, as in vLLM, because act-order may put any input in any group: a rank whose
inputs fill whole groups picks those out and runs the packed kernel; one whose act-order inputs
leave groups partly on the other ranks is dequantized at load (vLLM likewise gives up its
ExLlama kernel for act-order row-parallel layers).
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from typing import ClassVar

import torch

from engine.interfaces import QuantMethod
from engine.layers.group_affine import AffineWeight
from engine_quant_awq_gptq.config import PackedIntConfig, awq_config, gptq_config
from engine_quant_awq_gptq.formats import Shard, awq_shard, gptq_shard
from engine_quant_awq_gptq.kernels import dense_kernel, group_affine_kernel, probe_path
from engine_quant_awq_gptq.sharding import check_whole_words, rank_note, split_dims

logger = logging.getLogger(__name__)

TensorDims = dict[str, tuple[int | None, int | None]]

PATHS = {
    "packed": "the platform's packed group-affine kernel (as GGUF Q4_1; groups of 64/128 split into 32)",
    "int4pack": "int4pack planes (torch's CPU int4 matmul)",
    "dense": "dequantized at load to the activation dtype (no group-affine kernel here)",
    "float": "the checkpoint's float weight (a module it leaves unquantized)",
}


class PackedIntLinearMethod(QuantMethod):
    """What AWQ and GPTQ share: per-shard tensors -> :class:`Shard` -> one kernel per layer."""

    tensor_names: ClassVar[tuple[str, ...]]
    # (output_dim, input_dim) of each checkpoint tensor: the dims a rank's part is cut along
    tensor_dims: ClassVar[TensorDims]
    shards_for_tensor_parallel = True

    def __init__(self, ctx):
        super().__init__(ctx)
        if ctx.quant_config is None:
            raise ValueError(
                f"quantization: {self.name} reads {self.name} checkpoints; it does not quantize online"
            )
        self.config = self.read_config(ctx.quant_config)

    @staticmethod
    @abstractmethod
    def read_config(quant_config: dict) -> PackedIntConfig:
        """The checkpoint's settings, checked (ValueError naming a bad one)."""

    @abstractmethod
    def check_packing(self, input_size: int, output_sizes: list[int], split: tuple[bool, bool]) -> None:
        """Refuse sizes (a rank's, under ``split``) the format's int32 words cannot hold."""

    @abstractmethod
    def shard(self, tensors: dict, rows: int, inputs: int, group: int, whole_inputs: int) -> Shard:
        """One projection's checkpoint tensors ({name: tensor}) as a :class:`Shard`; ``inputs``
        of the layer's ``whole_inputs`` are this rank's."""

    @classmethod
    def describe(cls, platform) -> str:
        path = probe_path(platform)
        fallback = "" if path == "dense" else "; groups not a multiple of 32 dequantized at load"
        return f"{PATHS[path]}{fallback}"

    def create_weights(self, layer, input_size, output_sizes):
        split = split_dims(layer)
        layer.packed_int_group = self.config.group_for(input_size, rank_note(split))
        self.check_packing(input_size, output_sizes, split)
        shards: list[dict] = [dict() for _ in output_sizes]
        for name in (*self.tensor_names, "weight"):
            setattr(layer, name, ShardSink(shards, name, self.tensor_dims[name]))
        layer.packed_int_shards = shards

    def planned_kernel(self, input_size, output_sizes):
        """The kernel a layer of these sizes gets, on a zero weight (its path's layout and bytes)."""
        group, rows = self.config.group_for(input_size), sum(output_sizes)
        scale = torch.ones(rows, input_size // group)
        zero = torch.zeros(rows, input_size, dtype=torch.uint8)
        weight = AffineWeight(zero, scale, torch.zeros_like(scale), group, self.config.bits)
        return group_affine_kernel(weight, self.ctx.platform, self.ctx.dtype, self.ctx.batch_invariant)[0]

    def process_weights_after_loading(self, layer):
        parts, group = layer.packed_int_shards, layer.packed_int_group
        for name in (*self.tensor_names, "weight", "packed_int_shards", "packed_int_group"):
            delattr(layer, name)
        self._check_loaded(parts)
        inputs = (layer.input_size, group, layer.full_input_size)
        if any("weight" in part for part in parts):
            dense = torch.cat(
                [
                    part["weight"].float()
                    if "weight" in part
                    else self.shard(part, rows, *inputs).dequantize_in_input_order()
                    for part, rows in zip(parts, layer.output_sizes)
                ]
            )
            layer.kernel, layer.kernel_path = dense_kernel(dense, self.ctx.platform, self.ctx.dtype), "float"
            layer.register_buffer("input_order", None)
        else:
            shards = [self.shard(part, rows, *inputs) for part, rows in zip(parts, layer.output_sizes)]
            self._build_kernel(layer, shards)
        if layer.kernel_path != "packed":
            shape = (sum(layer.output_sizes), layer.input_size)
            logger.info("%s: a %s layer runs %s", self.name, shape, PATHS[layer.kernel_path])

    def _check_loaded(self, parts: list[dict]) -> None:
        for index, part in enumerate(parts):
            missing = [name for name in self.tensor_names if name not in part]
            if missing and "weight" not in part:
                raise ValueError(
                    f"quantization: {self.name} checkpoint lacks {missing} of shard {index} of a layer"
                )

    def _build_kernel(self, layer, shards: list[Shard]) -> None:
        """One kernel for the fused layer; dequantized when its shards' input orders differ."""
        orders = [shard.input_order for shard in shards]
        if all(_same_order(order, orders[0]) for order in orders):
            weight = AffineWeight.cat([shard.weight for shard in shards])
            layer.kernel, layer.kernel_path = group_affine_kernel(
                weight, self.ctx.platform, self.ctx.dtype, self.ctx.batch_invariant
            )
            layer.register_buffer("input_order", orders[0])
        else:
            dense = torch.cat([shard.dequantize_in_input_order() for shard in shards])
            layer.kernel, layer.kernel_path = dense_kernel(dense, self.ctx.platform, self.ctx.dtype), "dense"
            layer.register_buffer("input_order", None)

    def kernel_of(self, layer):
        return layer.kernel

    def apply(self, layer, x, bias):
        if layer.input_order is not None:
            x = x.index_select(-1, layer.input_order)
        out = layer.kernel(x)
        return out if bias is None else out + bias

    def dequantize(self, layer):
        w = layer.kernel.dequantize().float()
        if layer.input_order is not None:
            natural = torch.empty_like(w)
            natural[:, layer.input_order] = w
            w = natural
        return w.to(self.ctx.dtype)


class ShardSink:
    """Where ``Linear.load_shard`` hands the shards of one checkpoint tensor name. Not a
    parameter: a layer's checkpoint holds either the packed tensors or, for a module it leaves
    unquantized (``modules_to_not_convert``), a float ``weight``, and which is known only once
    loaded — so the core's check for unloaded parameters cannot apply, and the method checks
    (:meth:`PackedIntLinearMethod.process_weights_after_loading`). ``dims``: the tensor's
    (output_dim, input_dim), which a tensor-parallel layer cuts the rank's part along."""

    def __init__(self, shards: list[dict], name: str, dims: tuple[int | None, int | None]):
        self.shards, self.name = shards, name
        self.output_dim, self.input_dim = dims

    def weight_loader(self, param, tensor, shard: int) -> None:
        self.shards[shard][self.name] = tensor


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


FLOAT_WEIGHT_DIMS = (0, 1)  # a module the checkpoint leaves unquantized: weight [out, in]


class AwqLinearMethod(PackedIntLinearMethod):
    name = "awq"
    tensor_names = ("qweight", "qzeros", "scales")
    # qweight [K, N/8], qzeros [K/group, N/8], scales [K/group, N]: rows are inputs, columns outputs
    tensor_dims: ClassVar[TensorDims] = {name: (1, 0) for name in tensor_names} | {
        "weight": FLOAT_WEIGHT_DIMS
    }

    @staticmethod
    def read_config(quant_config):
        return awq_config(quant_config)

    def check_packing(self, input_size, output_sizes, split):
        check_whole_words("awq", 8, None, output_sizes, split)

    def shard(self, tensors, rows, inputs, group, whole_inputs):
        return awq_shard(tensors, self.config, rows, inputs, group)


class GptqLinearMethod(PackedIntLinearMethod):
    name = "gptq"
    tensor_names = ("qweight", "qzeros", "scales", "g_idx")
    # qweight [K/words, N], g_idx [K]; scales [G, N] and qzeros [G, N/words] whole along the
    # groups on a row-parallel rank (act-order: its inputs may fall in any group)
    tensor_dims: ClassVar[TensorDims] = {
        "qweight": (1, 0),
        "qzeros": (1, None),
        "scales": (1, None),
        "g_idx": (None, 0),
        "weight": FLOAT_WEIGHT_DIMS,
    }

    @staticmethod
    def read_config(quant_config):
        return gptq_config(quant_config)

    def check_packing(self, input_size, output_sizes, split):
        check_whole_words("gptq", 32 // self.config.bits, input_size, output_sizes, split)

    def shard(self, tensors, rows, inputs, group, whole_inputs):
        stored_groups = whole_inputs // (self.config.group or whole_inputs)
        return gptq_shard(tensors, self.config, rows, inputs, group, stored_groups)
