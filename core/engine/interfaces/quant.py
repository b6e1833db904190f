"""QuantMethod: how a linear layer stores its weight and multiplies by it.

The core's ``unquantized`` method is the default. A checkpoint's
``quantization_config.quant_method`` or ``--quantization NAME`` selects another.
Lifecycle per layer: ``create_weights`` (register parameters on the layer, each with
an ``output_dim`` attribute for shard loading, or a ``weight_loader(param, tensor,
shard)`` attribute of its own) → weights are loaded → ``process_weights_after_loading``
(repack, quantize online) → ``apply`` every forward.

When the selected method is the one the checkpoint declares, the loader is asked to keep
the file's own quantized form (``ModelLoader.iter_weights(keep_quantized=True)``): the
method's weight loaders then receive whatever objects that loader documents (e.g. raw
GGUF blocks), not float tensors.

Vocabulary-sized layers (input embedding, LM head) go through the method only when it sets
``quantizes_embeddings``; otherwise the core keeps them unquantized.

Mixture-of-experts layers (:class:`engine.layers.moe.FusedMoE`) hold each projection of all
experts stacked, [E, out, in] (an :class:`engine.layers.moe.ExpertLinear`). They go through
the method only when it sets ``quantizes_experts``, and then through the ``*_moe_*``
methods, the same lifecycle as a linear layer's: ``create_moe_weights`` →
experts loaded one (expert, shard) at a time → ``process_moe_weights_after_loading`` →
``apply_moe`` on rows sorted by expert → ``dequantize_moe``, the plain-math reference.
Otherwise the core keeps experts in the activation dtype (the ``unquantized`` method's).

Tensor parallelism (interface v3; a v2 method keeps the default, False, and is refused for
``tensor_parallel_size > 1``, naming it): a method that sets ``shards_for_tensor_parallel``
declares how its weights shard. Each parameter it registers carries ``output_dim`` (the dim
holding the [out, in] weight's rows) and, where its columns are stored, ``input_dim``. A
rank's part is the proportional slice of the checkpoint tensor along each, so a packed dim
must keep whole packing units per rank (else loading fails, naming the range); a
``weight_loader`` receives that part — with a kept-quantized checkpoint, in the loader's
kept-quantized form (the loader reads only that part: ``ModelLoader.iter_weight_slices``,
which may refuse a split its blocks cannot make). Column-parallel layers get the rank's
rows of each fused projection, row-parallel ones its input columns
(``engine.layers.parallel``; under GQA the attention's column ranges follow kv-head groups
and may be uneven), vocabulary tables their vocabulary rows (fewer on the last rank: pad
with zero rows). ``process_weights_after_loading`` then sees only the rank's part: a
per-output-row statistic over whole rows (an int8 scale) comes from
``layer.full_row_max(values)`` (a collective on a row-parallel layer: call it on every rank).

Experts under tensor parallelism (interface v6): a method that sets ``splits_experts`` has
each rank store every expert's slice of the intermediate dimension (gate|up rows, down
columns), cut from each expert's checkpoint tensor proportionally along its expert
parameters' ``output_dim`` / ``input_dim`` (counted within one expert) as a linear layer's
are; nothing ``process_moe_weights_after_loading`` computes may span a whole down row. Any
other method's experts stay whole on every rank (``experts_whole_because`` says why, in
``engine plugins`` and the start-up log); v5 methods keep that default.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn

# rows per call of a matmul under ``--batch-invariant`` when the method knows no better
# (``engine.layers.batch_invariant`` says why 16)
ROWS = 16


def in_row_tiles(matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``matmul`` applied to ``x`` [..., K] in tiles of exactly ``ROWS`` rows, the last one
    padded with zero rows: every row meets the same kernel on the same shape, whatever the batch."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count == 0:
        return matmul(rows).reshape(*x.shape[:-1], -1)
    padded = -(-count // ROWS) * ROWS
    if padded != count:
        rows = torch.cat([rows, rows.new_zeros(padded - count, rows.shape[1])])
    out = torch.cat([matmul(tile) for tile in rows.split(ROWS)])
    return out[:count].reshape(*x.shape[:-1], out.shape[-1])


def takes_whole(kernel: nn.Module | None, rows: int) -> bool:
    """Whether ``kernel`` gives each of ``rows`` rows in one call the bits it gets alone: its
    ``invariant_rows`` (:meth:`engine.layers.ops.LayerOps.pack_affine`) is None (any number) or
    at least ``rows``; missing or 0 where it declares nothing."""
    limit = getattr(kernel, "invariant_rows", 0)
    return limit is None or 0 < rows <= limit


def in_invariant_calls(
    kernel: nn.Module | None, matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> torch.Tensor | None:
    """``matmul`` (``kernel``'s) applied to ``x`` [T, K] in calls of at most ``kernel``'s
    ``invariant_rows`` (one call where it holds T), no row padded; None where the kernel
    declares nothing (then tile, :func:`in_row_tiles`, or probe:
    :func:`engine.layers.batch_invariant.in_row_buckets`)."""
    limit = getattr(kernel, "invariant_rows", 0)
    if limit == 0:
        return None
    if takes_whole(kernel, x.shape[0]):
        return matmul(x)
    return torch.cat([matmul(part) for part in x.split(limit)])


@attrs.frozen
class QuantContext:
    quant_config: dict[str, Any] | None  # from the checkpoint; None for online quantization
    dtype: torch.dtype  # activation dtype
    platform: Any
    batch_invariant: bool = False  # EngineConfig.batch_invariant: Linear runs fixed-size row tiles


class QuantMethod(ABC):
    name: ClassVar[str]
    quantizes_embeddings: ClassVar[bool] = False
    quantizes_experts: ClassVar[bool] = False  # implements the *_moe_* methods below
    shards_for_tensor_parallel: ClassVar[bool] = False  # parameters declare output_dim/input_dim (above)
    splits_experts: ClassVar[bool] = False  # (v6) experts split by intermediate slice under TP (above)
    experts_whole_because: ClassVar[str] = "the method declares no split of its stacked experts"
    # apply_greedy may be called under --batch-invariant too (below)
    greedy_batch_invariant: ClassVar[bool] = False

    def __init__(self, ctx: QuantContext):
        self.ctx = ctx

    @classmethod
    def supports(cls, platform) -> list[str]:
        """Reasons this method cannot run on ``platform``; empty when it can."""
        return []

    @classmethod
    def describe(cls, platform) -> str:
        """Which kernel path this method takes on ``platform`` and why (``engine plugins``)."""
        return ""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        """Register the layer's parameters for a [sum(output_sizes), input_size] weight."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack or quantize once all weights are loaded."""

    def checkpoint_tensor_name(self, name: str) -> str:
        """The name a checkpoint tensor loads under (interface v4), asked of the engine's one
        method instance for every tensor before the model's own renaming. A format whose
        per-layer tensors hang below the weight's own name (bitsandbytes' ``q_proj.weight.absmax``)
        renames them to a parameter of the layer (``q_proj.weight_absmax``); one whose scheme
        depends on the module's name (compressed-tensors' config groups) can route each tensor
        to its scheme's slot. This default keeps every name."""
        return name

    def planned_kernel(self, input_size: int, output_sizes: list[int]) -> nn.Module | None:
        """For ``engine serve --dry-run`` (interface v5): a module holding what a linear layer of
        these sizes holds once loaded — its kernel built on a zero weight of the shape, say —
        for a method whose ``create_weights`` registers no tensors of that size (the
        checkpoint's tensors reach the layer through sinks and become its kernel at load). The
        start-up plan counts its tensors in place of the layer's (built on the CPU, once per
        shape). This default, None, counts the tensors ``create_weights`` registered."""
        return None

    def check_checkpoint_modules(self, modules: set[str]) -> None:
        """Called once the checkpoint is read, before any layer is processed, with the module
        names its tensors belong to (each tensor's name less its last part, as the checkpoint
        spells it): raise ValueError naming a setting of ``quant_config`` that names a module
        the checkpoint lacks (a skip list entry matching nothing). This default checks nothing."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, in] -> [T, out]."""

    def kernel_of(self, layer: nn.Module) -> nn.Module | None:
        """The module whose call is ``apply``'s matmul for ``layer`` where there is one (e.g. a
        platform's packed weight, :meth:`engine.layers.ops.LayerOps.pack_affine`), read for
        its ``invariant_rows`` under ``--batch-invariant``; this default, None: none."""
        return None

    def apply_batch_invariant(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``apply`` under ``--batch-invariant``: each row's result must not depend on how many
        rows share the call (nor on where in it the row sits). This default runs ``apply``
        unpadded where ``kernel_of(layer)`` declares ``invariant_rows``
        (:func:`in_invariant_calls`: one call a decode step), else on tiles of exactly
        :data:`ROWS` rows (:func:`in_row_tiles`), right for any kernel whose rows do not
        interact; a method whose kernel gives a row the same bits at other row counts may
        override it to run fewer, bigger calls (:func:`engine.layers.batch_invariant.in_row_buckets`
        finds such counts by probing)."""

        def matmul(rows: torch.Tensor) -> torch.Tensor:
            return self.apply(layer, rows, bias)

        out = in_invariant_calls(self.kernel_of(layer), matmul, x)
        return in_row_tiles(matmul, x) if out is None else out

    def apply_greedy(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """For a vocabulary table's LM head (a method that sets ``quantizes_embeddings``), in a
        step whose rows all decode greedily: each row's first maximum of ``apply(layer, x,
        None)`` (int64 [T]; NaN counts as the maximum), the very token the logits give, found a
        faster way (e.g. without writing every logit). This default, None: there is none, and
        the engine takes the argmax of the logits. Under ``--batch-invariant`` it is called
        only for a method that sets ``greedy_batch_invariant``, and must then give the tokens of
        ``apply_batch_invariant``'s logits (or None)."""
        return None

    @abstractmethod
    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight [out, in] in the activation dtype, by plain math: the reference
        ``apply`` is checked against (dequantize-then-matmul)."""

    def embed(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``input_ids`` of the weight [vocab, hidden], for methods that set
        ``quantizes_embeddings``. This default dequantizes the whole table: override it."""
        return F.embedding(input_ids, self.dequantize(layer))

    # -- mixture-of-experts layers, for methods that set ``quantizes_experts`` -------------------

    def create_moe_weights(
        self, layer: nn.Module, num_experts: int, input_size: int, output_sizes: list[int]
    ) -> None:
        """Register the parameters of a stacked projection [num_experts, sum(output_sizes),
        input_size], leading dimension the (local) expert. ``output_dim`` counts within one
        expert's slice; a parameter may carry ``expert_weight_loader(param, tensor, expert,
        shard)`` to receive checkpoint tensors itself (e.g. raw GGUF blocks). This default
        registers ``weight`` in the activation dtype (what an online method quantizes in
        ``process_moe_weights_after_loading``)."""
        weight = nn.Parameter(
            torch.empty(num_experts, sum(output_sizes), input_size, dtype=self.ctx.dtype), requires_grad=False
        )
        weight.output_dim, weight.input_dim = 0, 1  # type: ignore[attr-defined]  # read off the parameter
        layer.register_parameter("weight", weight)

    def process_moe_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack or quantize once every expert is loaded."""

    def apply_moe(self, layer: nn.Module, x: torch.Tensor, segments) -> torch.Tensor:
        """x [M, in], rows sorted by expert (``segments``: an
        :class:`engine.layers.experts.ExpertSegments`) -> [M, out], each segment times its expert's
        weight. ``engine.layers.experts.grouped_matmul`` runs stacked float weights;
        ``segments.per_expert`` loops a one-weight kernel over the experts that have rows."""
        raise NotImplementedError(f"{type(self).__name__} sets quantizes_experts but has no apply_moe")

    def dequantize_moe(self, layer: nn.Module) -> torch.Tensor:
        """The stacked weight [E, out, in] in the activation dtype, by plain math: the
        reference ``apply_moe`` is checked against."""
        raise NotImplementedError(f"{type(self).__name__} sets quantizes_experts but has no dequantize_moe")
