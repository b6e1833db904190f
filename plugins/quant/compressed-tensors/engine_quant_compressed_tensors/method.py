"""The ``compressed-tensors`` quant method: checkpoints whose ``quantization_config.quant_method``
is ``compressed-tensors`` (written by llm-compressor / the compressed-tensors library).

Per layer, the checkpoint's tensors are collected shard by shard (q/k/v and gate/up fused here,
:mod:`engine_quant_compressed_tensors.loading`) and turned into one kernel, by the scheme of the
config group whose ``targets`` match the layer (:mod:`engine_quant_compressed_tensors.config`;
mixed precision: several groups, e.g. W4A16 attention and W8A8 MLP, each layer by its own):

* ``pack-quantized`` W4A16 / W8A16 (group or channel, symmetric or not) and weight-only
  ``int-quantized``: a group-affine weight on the kernel AWQ and GPTQ take (the platform's
  packed kernel, else int4pack planes, else dequantized at load);
* ``int-quantized`` W8A8: int8 rows as they are stored, activations rounded per token
  (dynamic; the platform's packed kernel where it has one, as the int8 plugin does) or by the
  checkpoint's per-tensor ``input_scale`` (static);
* ``float-quantized`` FP8: the fp8 plugin's method runs the layer;
* ``nvfp4-pack-quantized`` (NVFP4A16, and W4A4 with its activations rounded to NVFP4 as the
  checkpoint says): e2m1 codes with a float8 scale per 16 over a global scale, an FP4 weight on
  the platform's FP4 kernel (``LayerOps.pack_fp4``; cpu-native: codes decoded inside the
  matmul), else dequantized at load.

A module the checkpoint leaves unquantized (``ignore``, or not targeted) arrives as a float
``weight`` and stays float. Mixture-of-experts experts: each expert gets the kernel a linear
layer of its tensors would (static input scales refused, as vLLM refuses them). Quantized
vocabulary tables are not read.

Tensor parallelism: every tensor declares the dims a rank's part is cut along
(:func:`engine_quant_compressed_tensors.loading.tensor_dims`); each rank builds its kernel from
its part alone, with the checkpoint's own scales, so its values are exactly TP=1's. A split
that would cut a packing word, a scale group or an FP8 block across ranks is refused at
start-up, naming it.
"""

from __future__ import annotations

import logging

import torch

from engine.interfaces import QuantMethod
from engine.layers.batch_invariant import invariant_packing
from engine.layers.fp4 import Fp4Weight
from engine.layers.group_affine import AffineWeight
from engine_quant_awq_gptq.kernels import dense_kernel, group_affine_kernel, probe_path
from engine_quant_compressed_tensors import formats
from engine_quant_compressed_tensors.config import Scheme, check_ignore, group_of, read_groups, read_ignore
from engine_quant_compressed_tensors.kernels import (
    DynamicInt8,
    Fp8Layer,
    fp4_kernel,
    fp4_probe,
    int8_rows,
    nvfp4_activations,
    static_int8,
)
from engine_quant_compressed_tensors.loading import (
    GROUP_TENSORS,
    Loading,
    Projections,
    check_sizes,
    register_sinks,
    sink_name,
)

logger = logging.getLogger(__name__)

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
    "fp4": "the platform's FP4 kernel (e2m1 codes and block scales decoded inside the matmul)",
    "nvfp4-w4a4": "activations rounded to NVFP4 per 16 inputs as the checkpoint says, then the weight's path",
    "float": "the checkpoint's float weight (a module it leaves unquantized)",
}


class CompressedTensorsLinearMethod(QuantMethod):
    name = "compressed-tensors"
    quantizes_experts = True  # each expert a kernel of its own, as a linear layer's
    shards_for_tensor_parallel = True  # each tensor declares the dims it splits along (loading.tensor_dims)

    def __init__(self, ctx):
        super().__init__(ctx)
        if ctx.quant_config is None:
            raise ValueError(
                "quantization: compressed-tensors reads its checkpoints; it does not quantize online"
            )
        self.groups = read_groups(ctx.quant_config)
        self.ignore = read_ignore(ctx.quant_config)
        self.schemes = {group.name: group.scheme for group in self.groups}
        self.module_groups: dict[str, str] = {}  # checkpoint module -> its config group's name

    def check_checkpoint_modules(self, modules):
        check_ignore(self.ignore, modules)

    def checkpoint_tensor_name(self, name):
        """With several config groups, a quantized tensor loads under its group's name
        (:func:`engine_quant_compressed_tensors.loading.sink_name`): its module matched to the
        group by the targets (:func:`engine_quant_compressed_tensors.config.group_of`). An
        instance method where the interface has a class method: the match needs this
        checkpoint's groups (the core calls it on the method it built)."""
        module, _, tensor = name.rpartition(".")
        if len(self.groups) == 1 or tensor not in GROUP_TENSORS:
            return name
        if module not in self.module_groups:
            group = group_of(module, self.groups, self.ignore)
            if group is None:
                raise ValueError(
                    f"quantization: compressed-tensors module {module!r} holds {tensor} but no "
                    "config group targets it (or it is ignored)"
                )
            self.module_groups[module] = group.name
        return f"{module}.{sink_name(tensor, self.module_groups[module], True)}"

    @classmethod
    def describe(cls, platform) -> str:
        affine, fp4 = PATHS[probe_path(platform)], PATHS[fp4_probe(platform)]
        return (
            f"pack-quantized and weight-only int: {affine}; int W8A8: torch._int_mm or the platform's "
            f"packed kernel; FP8: the fp8 plugin's path; NVFP4: {fp4} "
            "(W4A4: activations rounded to NVFP4 first)"
        )

    def planned_kernel(self, input_size, output_sizes):
        """The kernel a layer of these sizes gets, built on zero tensors of its scheme; None with
        several config groups (a layer's group shows only in its checkpoint names)."""
        if len(self.groups) != 1:
            return None
        scheme = self.groups[0].scheme
        parts = [formats.zero_tensors(scheme, rows, input_size) for rows in output_sizes]
        return self._kernel(scheme, parts, output_sizes, input_size)[0]

    def create_weights(self, layer, input_size, output_sizes):
        layer.ct_loading = self._loading(layer, input_size, output_sizes)

    def create_moe_weights(self, layer, num_experts, input_size, output_sizes):
        layer.ct_loading = self._loading(layer, input_size, output_sizes, num_experts)

    def _loading(self, layer, input_size: int, output_sizes: list[int], experts: int = 1) -> Loading:
        loading = register_sinks(layer, self.groups, len(output_sizes), experts)
        if len(self.groups) == 1:  # the layer's scheme known: refused before any tensor is read
            check_sizes(self.groups[0].scheme, loading.split, input_size, output_sizes)
        return loading

    def _loaded(self, layer) -> Loading:
        loading = layer.ct_loading
        for name in (*loading.sink_names, "ct_loading"):
            delattr(layer, name)
        return loading

    def process_weights_after_loading(self, layer):
        loading = self._loaded(layer)
        whole = (layer.full_output_sizes, layer.full_input_size)
        layer.kernel, layer.kernel_path = self._built(loading, loading.weights[0], layer, whole)

    def process_moe_weights_after_loading(self, layer):
        """Each expert's kernel, as a linear layer of its tensors gets (experts are whole on a rank)."""
        loading = self._loaded(layer)
        whole = (layer.output_sizes, layer.input_size)
        for expert in loading.weights:
            scheme = self._layer_scheme(expert.groups, expert.parts)
            if (
                scheme is not None
                and scheme.activations is not None
                and scheme.activations.scales == "static"
            ):
                raise ValueError(
                    "quantization: compressed-tensors experts of a mixture-of-experts layer with "
                    "static input scales are not supported (as in vLLM: int8 experts take dynamic "
                    "per-token activations)"
                )
        built = [self._built(loading, expert, layer, whole) for expert in loading.weights]
        layer.experts = torch.nn.ModuleList(kernel for kernel, _ in built)

    def _built(self, loading: Loading, weight: Projections, layer, whole: tuple[list[int], int]):
        """-> (the kernel of ``weight``, one of ``layer``'s, its path's name); ``whole``: the
        checkpoint's output sizes and input size, of which a tensor-parallel rank holds a part."""
        parts, output_sizes, input_size = weight.parts, layer.output_sizes, layer.input_size
        scheme = self._layer_scheme(weight.groups, parts)
        if scheme is not None:
            if len(self.groups) > 1:  # one group: checked in create_weights
                check_sizes(scheme, loading.split, input_size, output_sizes)
            self._check_loaded(scheme, parts, whole)
        if scheme is None or any(_is_float(part) for part in parts):
            dense = torch.cat(
                [self._dequantized(scheme, part, rows, input_size) for part, rows in zip(parts, output_sizes)]
            )
            kernel, path = dense_kernel(dense, self.ctx.platform, self.ctx.dtype), "float"
        else:
            kernel, path = self._kernel(scheme, parts, output_sizes, input_size)
        if path not in ("packed", "w8a8-packed", "fp4"):
            shape = (sum(output_sizes), input_size)
            logger.info("compressed-tensors: a %s weight runs %s", shape, PATHS[path])
        return kernel, path

    def _layer_scheme(self, groups: list[set[str]], parts: list[dict]) -> Scheme | None:
        """The scheme of the layer's quantized projections (None: all float). Fused projections
        (q/k/v, gate/up) of different schemes are refused, as vLLM refuses them."""
        names = sorted(set().union(*groups))
        schemes = {self.schemes[name] for name in names}
        if len(schemes) > 1:
            raise ValueError(
                f"quantization: compressed-tensors fused projections (q/k/v or gate/up) of a layer "
                f"fall in config_groups {names} of different schemes (one scheme a layer)"
            )
        if schemes:
            return schemes.pop()
        if all(_is_float(part) for part in parts):
            return None
        return self.groups[
            0
        ].scheme  # a quantized weight without its group's tensors: _check_loaded names them

    def _check_loaded(self, scheme: Scheme, parts: list[dict], whole: tuple[list[int], int]) -> None:
        required = REQUIRED[scheme.format]
        if not scheme.weights.symmetric:
            required += ("weight_zero_point",)
        scales = getattr(scheme.activations, "scales", None)
        required += {"static": ("input_scale",), "nvfp4": ("input_global_scale",)}.get(scales, ())
        for index, part in enumerate(parts):
            missing = [name for name in required if name not in part]
            if missing and not _is_float(part):
                raise ValueError(
                    f"quantization: compressed-tensors checkpoint lacks {missing} of shard {index} of a layer"
                )
            if "weight_shape" in part:  # the whole projection's, as the checkpoint holds it
                formats.check_weight_shape(part, (whole[0][index], whole[1]))

    def _quantized(self, scheme: Scheme, part: dict, rows: int, inputs: int) -> AffineWeight | Fp4Weight:
        """A shard as a group-affine weight (the int formats) or an FP4 weight (NVFP4)."""
        read = {
            "pack-quantized": formats.packed_int,
            "int-quantized": formats.int8_values,
            "nvfp4-pack-quantized": formats.nvfp4,
        }[scheme.format]
        return read(part, scheme.weights, rows, inputs)

    def _dequantized(self, scheme: Scheme | None, part: dict, rows: int, inputs: int) -> torch.Tensor:
        """A shard's weight in float32 (for a fused layer of which the checkpoint left part float)."""
        if _is_float(part) or scheme is None:
            return part["weight"].float()
        if scheme.format == "float-quantized":
            return Fp8Layer(self.ctx, scheme.weights.block, [part], [rows]).dequantize().float()
        return self._quantized(scheme, part, rows, inputs).dequantize()

    def _kernel(self, scheme: Scheme, parts: list[dict], output_sizes: list[int], inputs: int):
        """-> (the module computing x · wᵀ, its path's name)."""
        ctx = self.ctx
        if scheme.format == "float-quantized":
            return Fp8Layer(ctx, scheme.weights.block, parts, output_sizes), "fp8"
        shards = [self._quantized(scheme, part, rows, inputs) for part, rows in zip(parts, output_sizes)]
        ops = ctx.platform.layer_ops(ctx.dtype)
        if scheme.format == "nvfp4-pack-quantized" and scheme.activations is None:
            return fp4_kernel(Fp4Weight.cat(shards), ctx.platform, ctx.dtype)
        if scheme.activations is None:
            return group_affine_kernel(AffineWeight.cat(shards), ctx.platform, ctx.dtype, ctx.batch_invariant)
        if scheme.activations.scales == "nvfp4":
            scales = [_scalar(part["input_global_scale"]) for part in parts]
            return nvfp4_activations(list(zip(shards, scales)), ctx.platform, ctx.dtype), "nvfp4-w4a4"
        if scheme.activations.scales == "static":
            scales = [_scalar(part["input_scale"]) for part in parts]
            return static_int8(list(zip(shards, scales)), ctx.dtype, ops), "w8a8-static"
        rows = int8_rows(AffineWeight.cat(shards), ctx.dtype, ops)
        affine = rows.as_affine()
        packed = ops.pack_affine(affine) if affine is not None else None
        if packed is not None:
            return invariant_packing(packed, ctx.batch_invariant), "w8a8-packed"
        return DynamicInt8(rows, own_outliers=ctx.batch_invariant), "w8a8-dynamic"

    def kernel_of(self, layer):
        return layer.kernel

    def apply(self, layer, x, bias):
        out = layer.kernel(x)
        return out if bias is None else out + bias

    def dequantize(self, layer):
        return layer.kernel.dequantize().to(self.ctx.dtype)

    def apply_moe(self, layer, x, segments):
        experts = layer.experts
        return segments.per_expert(x, sum(layer.output_sizes), lambda e, rows: experts[e](rows))

    def dequantize_moe(self, layer):
        return torch.stack([expert.dequantize() for expert in layer.experts]).to(self.ctx.dtype)


def _scalar(tensor: torch.Tensor) -> float:
    return float(tensor.float().reshape(-1)[0])


def _is_float(part: dict) -> bool:
    """A shard the checkpoint stores unquantized: a float ``weight`` and nothing packed."""
    weight = part.get("weight")
    return weight is not None and weight.is_floating_point() and weight.element_size() > 1
