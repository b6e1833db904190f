"""Where a layer's compressed-tensors tensors land while the checkpoint loads, and what a
tensor-parallel rank's part of each is.

Per fused projection (q/k/v, gate/up; of each expert, for a mixture-of-experts layer) the
tensors are kept by name, with the config groups they were written by: with several groups
(mixed precision) every quantized tensor loads under its group's name (``weight_scale@group_1``,
:func:`sink_name`), the method having matched its module to the group
(:meth:`CompressedTensorsLinearMethod.checkpoint_tensor_name`), so that the layer knows which
scheme it holds. The ``weight`` itself (float, int8 or FP8) says nothing of a group and loads
under its own name.

Each tensor declares the dims a rank's part is cut along (:func:`tensor_dims`): the weight,
packed words and per-row or per-group scales and zero points along their rows and, where they
hold columns, their columns; per-tensor scales (the weight's, global or input) are whole on
every rank. :func:`check_sizes` refuses a layer — under tensor parallelism, a rank's part of
one — that would cut a packing word, a scale group or an FP8 block (the words and the rank's
split as AWQ and GPTQ check them: ``engine_quant_awq_gptq.sharding``).
"""

from __future__ import annotations

import attrs

from engine_quant_awq_gptq.sharding import check_whole_words, rank_note, split_dims
from engine_quant_compressed_tensors import formats
from engine_quant_compressed_tensors.config import Group, Scheme, Weights

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
GROUP_TENSORS = TENSOR_NAMES[1:]  # all but the weight, which an unquantized module stores too
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


def sink_name(name: str, group: str, several_groups: bool) -> str:
    """The name a quantized tensor of config group ``group`` loads under."""
    return f"{name}@{group}" if several_groups else name


@attrs.define
class Projections:
    """The checkpoint tensors of one weight (a layer's, or one expert's of a mixture-of-experts
    layer) per fused projection (``parts``), and the config groups each projection's came from."""

    parts: list[dict]
    groups: list[set[str]]


@attrs.define
class Loading:
    """What a layer is loading: per weight (one, or one per local expert) its
    :class:`Projections`, the layer's split over ranks (:func:`split_dims`), and the names of
    its sinks (removed once loaded)."""

    weights: list[Projections]
    split: tuple[bool, bool]
    sink_names: tuple[str, ...] = ()


class TensorSink:
    """Where ``Linear.load_shard`` (``ExpertLinear.load_shard``: an expert's) hands one tensor
    name's shards. Not a parameter (as ``engine_quant_awq_gptq.method.ShardSink``): which
    tensors a layer holds — packed ones or, for a module the checkpoint leaves unquantized, a
    float ``weight`` — is known only once loaded, and the method checks. ``output_dim`` /
    ``input_dim``: :func:`tensor_dims`; ``group``: the config group whose tensors it receives
    (None: the weight's, any)."""

    def __init__(self, weights: list[Projections], name: str, dims: tuple[int | None, int | None], group):
        self.weights, self.name, self.group = weights, name, group
        self.output_dim, self.input_dim = dims

    def weight_loader(self, param, tensor, shard: int) -> None:
        self.expert_weight_loader(param, tensor, 0, shard)

    def expert_weight_loader(self, param, tensor, expert: int, shard: int) -> None:
        held = self.weights[expert]
        held.parts[shard][self.name] = tensor
        if self.group is not None:
            held.groups[shard].add(self.group)


def register_sinks(layer, groups: tuple[Group, ...], projections: int, experts: int = 1) -> Loading:
    """A sink on ``layer`` for every tensor name each group's modules may hold, for ``experts``
    weights of ``projections`` fused projections each."""
    weights = [
        Projections([{} for _ in range(projections)], [set() for _ in range(projections)])
        for _ in range(experts)
    ]
    sinks = {"weight": TensorSink(weights, "weight", (0, 1), None)}
    for group in groups:
        for name in GROUP_TENSORS:
            dims = tensor_dims(name, group.scheme.weights)
            sinks[sink_name(name, group.name, len(groups) > 1)] = TensorSink(weights, name, dims, group.name)
    for attribute, sink in sinks.items():
        setattr(layer, attribute, sink)
    return Loading(weights, split_dims(layer), tuple(sinks))


def check_sizes(scheme: Scheme, split: tuple[bool, bool], input_size: int, output_sizes: list[int]) -> None:
    """Refuse a layer whose sizes the scheme's words, groups or blocks cannot hold — under
    tensor parallelism, the sizes of this rank's part, so that none straddles two ranks."""
    weights = scheme.weights
    outputs_split, inputs_split = split
    formats.scale_groups(weights, input_size, rank_note(split))
    if scheme.format == "pack-quantized":  # zero points (asymmetric) pack along the outputs
        rows = output_sizes if not weights.symmetric else []
        check_whole_words("compressed-tensors", 32 // weights.bits, input_size, rows, split)
    if weights.block and (outputs_split or inputs_split):
        rows_per_block, columns_per_block = weights.block
        rows_cut = outputs_split and any(size % rows_per_block for size in output_sizes)
        if rows_cut or inputs_split and input_size % columns_per_block:
            raise ValueError(
                f"quantization: compressed-tensors FP8 blocks of {rows_per_block}x{columns_per_block} "
                f"would straddle tensor-parallel ranks: a rank holds output sizes {output_sizes} "
                f"and input size {input_size} of a layer, not whole blocks"
            )
