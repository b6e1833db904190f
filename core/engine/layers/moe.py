"""Mixture-of-experts: experts stored as stacked tensors and run as a grouped matmul.

:class:`FusedMoE` holds a layer's experts as two :class:`ExpertLinear` s — gate|up
[E, 2·I, H] and down [E, H, I] — whose storage and matmul come from the quant method
(``create_moe_weights`` / ``apply_moe``; methods that do not set ``quantizes_experts`` leave
experts in the activation dtype, as vocabulary tables). A forward routes each token to its
top-k experts, sorts the (token, expert) pairs by expert so each expert's rows are one
contiguous segment of a single gathered buffer, runs each projection as one grouped matmul
over those segments (:func:`engine.layers.experts.grouped_matmul`: ``torch._grouped_mm`` on the
CPU, else a loop over the experts that received rows — never over tokens), and scatter-adds
the weighted rows back to their tokens.

A family whose experts differ from plain SwiGLU passes its own ``activation`` (gate|up rows ->
hidden rows: gpt-oss's clamped SwiGLU) and ``bias=True`` for per-expert biases on both
projections, added to each row by the expert it went to.

Tensor parallelism (as vLLM splits experts): built for a group of several ranks, each rank
holds every expert's slice of the intermediate dimension — its rows of gate and of up, its
columns of down (:class:`IntermediateSlice`) — routing stays replicated (every rank routes the
same all-reduced hidden states the same way), and the layer's output, each rank's partial sum,
is all-reduced once. Per-expert down biases are added on rank 0 only, so the sum holds each
once. Only a quant method that sets ``splits_experts`` is split (its expert parameters declare
``output_dim`` and ``input_dim`` and nothing it computes at load spans a whole row); any other
keeps every expert whole on every rank, run on the replicated hidden states with no reduction
(exact, at the whole experts' memory per rank), and the start-up log says so and why
(:func:`expert_split_note`, also on the method's line of ``engine plugins``).

Expert parallelism: a layer is told which experts live on this rank (``local_experts``,
default all). It stores only those, and routing drops the (token, expert) pairs of the
others, so each rank's output is its experts' share of the sum; the executor all-reduces.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import attrs
import torch
from torch import nn

from engine.distributed import TensorParallel, current_tensor_parallel
from engine.layers.batch_invariant import ROWS, in_row_tiles
from engine.layers.checkpoint import materialize
from engine.layers.experts import ExpertSegments
from engine.layers.linear import Linear
from engine.layers.module import Layer
from engine.layers.parallel import proportional_part
from engine.layers.unquantized import UnquantizedLinearMethod

logger = logging.getLogger(__name__)

# checkpoint name of an expert's projection -> (FusedMoE attribute, shard): Mixtral's w1/w3/w2
# and the Qwen-MoE family's gate_proj/up_proj/down_proj
EXPERT_PROJECTIONS = {
    "w1": ("gate_up", 0),
    "w3": ("gate_up", 1),
    "w2": ("down", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """Softmax over the experts (float32), the ``top_k`` largest -> (weights float32 [T, k],
    expert ids int64 [T, k]); with ``renormalize`` the k weights are divided by their sum
    (Mixtral always; Qwen-MoE when ``norm_topk_prob``)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def router_linear(
    hidden_size: int, num_experts: int, method, dtype: torch.dtype, bias: bool = False
) -> Linear:
    """The router's [E, H] projection (with a bias: gpt-oss), kept in the activation dtype
    whatever the quant method (it only chooses experts and is tiny; vLLM leaves it unquantized too)."""
    return Linear(hidden_size, [num_experts], bias, UnquantizedLinearMethod(method.ctx), dtype)


def expert_method(method):
    """The method experts are stored through: ``method`` where it quantizes experts, else the
    activation dtype's (``unquantized``)."""
    return method if method.quantizes_experts else UnquantizedLinearMethod(method.ctx)


def expert_split_note(method_cls) -> str:
    """What tensor parallelism does with experts stored through ``method_cls`` (the class that
    stores them: :func:`expert_method`'s), for ``engine plugins`` and the start-up log."""
    if method_cls.splits_experts:
        return "experts split by intermediate slice under tensor parallelism"
    return f"experts whole on every rank under tensor parallelism: {method_cls.experts_whole_because}"


@functools.cache
def _log_whole_experts(note: str) -> None:
    """Once per process and reason: a tensor-parallel model's experts stay whole."""
    logger.warning("%s", note)


@attrs.frozen
class IntermediateSlice:
    """This rank's entries [start, start + length) of every expert's intermediate dimension
    (of ``full``): rows of gate and of up, columns of down. ``rank`` 0 adds down's biases."""

    start: int
    length: int
    full: int
    rank: int

    @classmethod
    def of(cls, intermediate_size: int, tp: TensorParallel) -> IntermediateSlice:
        start, length = tp.split(intermediate_size, "an expert's intermediate size")
        return cls(start, length, intermediate_size, tp.rank)


class ExpertLinear(Layer):
    """One projection of every local expert, [E, sum(output_sizes), input_size], stored and
    multiplied by the quant method (its ``*_moe_*`` methods); checkpoint tensors arrive one
    expert and shard at a time through :meth:`load_shard`. With ``bias`` each expert has a bias
    [E, sum(output_sizes)] in the activation dtype (whatever the method), loaded as ``bias``.

    ``sliced`` (tensor parallelism): this rank's :class:`IntermediateSlice`, of the output rows
    of each fused projection (``sliced_dim`` "output": gate|up) or of the input columns
    ("input": down); sizes given are the rank's. A checkpoint tensor is cut to the rank's part
    along the parameter's ``output_dim`` / ``input_dim`` before it is stored."""

    def __init__(
        self,
        num_experts: int,
        input_size: int,
        output_sizes: list[int],
        method,
        dtype: torch.dtype,
        bias: bool = False,
        sliced: IntermediateSlice | None = None,
        sliced_dim: str = "output",
    ):
        super().__init__()
        method = expert_method(method)
        self.sliced, self.sliced_dim = sliced, sliced_dim
        self.num_experts, self.input_size, self.output_sizes = num_experts, input_size, list(output_sizes)
        self.method = method
        self._unloaded = {(e, s) for e in range(num_experts) for s in range(len(output_sizes))}
        method.create_moe_weights(self, num_experts, input_size, self.output_sizes)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(num_experts, sum(output_sizes), dtype=dtype), requires_grad=False
            )
            self.bias.output_dim = 0  # type: ignore[attr-defined]  # load_shard narrows a shard by it

    def load_shard(self, param_name: str, tensor, expert: int, shard: int = 0) -> None:
        """Copy one expert's projection into its slice of the stacked parameter (or hand it to
        the parameter's ``expert_weight_loader(param, tensor, expert, shard)``); ``tensor`` may
        be a lazy :class:`~engine.layers.checkpoint.CheckpointSlice`, of which only this rank's
        part is read."""
        param = getattr(self, param_name)
        if self._bias_elsewhere(param_name):
            return  # down's biases live on rank 0 (added once to the all-reduced sum); zeros here
        tensor = self.rank_part(param_name, param, tensor)
        loader = getattr(param, "expert_weight_loader", None)
        if loader is not None:
            loader(param, tensor, expert, shard)
        else:
            target = param.data[expert]
            dim = getattr(param, "output_dim", None)
            if dim is not None and len(self.output_sizes) > 1:
                per_row = target.shape[dim] // sum(self.output_sizes)
                start = sum(self.output_sizes[:shard]) * per_row
                target = target.narrow(dim, start, self.output_sizes[shard] * per_row)
            target.copy_(tensor)
        if param_name != "bias":
            self._unloaded.discard((expert, shard))

    def _bias_elsewhere(self, param_name: str) -> bool:
        return (
            param_name == "bias"
            and self.sliced is not None
            and self.sliced_dim == "input"
            and self.sliced.rank != 0
        )

    def rank_part(self, param_name: str, param: torch.Tensor, tensor) -> torch.Tensor:
        """This rank's part of one expert's checkpoint ``tensor``: all of it unless sliced."""
        if self.sliced is None or (param_name == "bias" and self.sliced_dim == "input"):
            return materialize(tensor)
        dim = getattr(param, f"{self.sliced_dim}_dim", None)
        if dim is None:
            raise ValueError(
                f"tensor_parallel_size: expert parameter {param_name!r} of {self.method.name!r} "
                f"declares no {self.sliced_dim}_dim to split the intermediate size along"
            )
        sliced = self.sliced
        return proportional_part(tensor, dim, sliced.full, sliced.start, sliced.length)

    def process_weights_after_loading(self) -> None:
        if self._unloaded:
            shown = sorted(self._unloaded)
            raise ValueError(
                f"experts never loaded (expert, shard): {shown[:5]}{' ...' if len(shown) > 5 else ''}"
            )
        self.method.process_moe_weights_after_loading(self)

    def forward(self, x: torch.Tensor, segments: ExpertSegments) -> torch.Tensor:
        if getattr(self.method.ctx, "batch_invariant", False):
            out = self._in_row_tiles(x, segments)
        else:
            out = self.method.apply_moe(self, x, segments)
        return out if self.bias is None else out + self.bias[segments.expert_of_rows(out.device)]

    def _in_row_tiles(self, x: torch.Tensor, segments: ExpertSegments) -> torch.Tensor:
        """Batch-invariant mode: each expert's rows in tiles of exactly
        :data:`~engine.layers.batch_invariant.ROWS` (as every ``Linear``), so a row's result does
        not depend on how many other rows chose its expert this step."""

        def expert_tiles(expert: int, rows: torch.Tensor) -> torch.Tensor:
            one = ExpertSegments.single(expert, ROWS, self.num_experts)
            return in_row_tiles(lambda tile: self.method.apply_moe(self, tile, one), rows)

        return segments.per_expert(x, sum(self.output_sizes), expert_tiles)


class FusedMoE(Layer):
    """A layer's experts (SwiGLU, ``silu(x·gateᵀ) ∗ (x·upᵀ)·downᵀ``): ``forward(x, router_logits)``
    -> Σ over the token's top-k experts (those on this rank) of weight × expert(x).

    ``local_experts`` are the global ids of the experts this rank holds (default all); a
    checkpoint's other experts are skipped when loading. ``activation`` maps gate|up rows
    [M, 2·I] to [M, I] (default the platform's ``silu_and_mul``); ``bias`` gives both
    projections per-expert biases (checkpoint ``<e>.<projection>.bias``). Built for a
    tensor-parallel group, the experts are split by intermediate slice where the method
    allows (``split``), and the output is all-reduced (``reduce_results=False``: the caller
    reduces it, with a shared expert's, through :meth:`with_shared`)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        method,
        dtype: torch.dtype,
        ops,
        local_experts: Sequence[int] | None = None,
        activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
        bias: bool = False,
        reduce_results: bool = True,
    ):
        super().__init__()
        self.reduce_results = reduce_results
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.activation = activation or ops.silu_and_mul
        self.local_experts = list(range(num_experts) if local_experts is None else local_experts)
        if not set(self.local_experts) <= set(range(num_experts)) or len(set(self.local_experts)) < len(
            self.local_experts
        ):
            raise ValueError(
                f"local_experts must be distinct expert ids below {num_experts}: {self.local_experts}"
            )
        local_index = torch.full((num_experts,), -1, dtype=torch.long)
        local_index[self.local_experts] = torch.arange(len(self.local_experts))
        self.register_buffer("local_index", local_index, persistent=False)
        tp, stored = current_tensor_parallel(), expert_method(method)
        if tp.size > 1 and not stored.splits_experts:
            _log_whole_experts(expert_split_note(type(stored)))
        self.split = tp.size > 1 and stored.splits_experts
        self.group = tp
        sliced = IntermediateSlice.of(intermediate_size, tp) if self.split else None
        local = sliced.length if sliced is not None else intermediate_size
        experts = len(self.local_experts)
        self.gate_up = ExpertLinear(experts, hidden_size, [local] * 2, method, dtype, bias, sliced, "output")
        self.down = ExpertLinear(experts, local, [hidden_size], method, dtype, bias, sliced, "input")

    def load_expert(self, projection: str, param_name: str, expert: int, tensor) -> bool:
        """Load checkpoint expert ``expert``'s ``projection`` (a key of
        :data:`EXPERT_PROJECTIONS`); False (and nothing loaded) for an expert on another rank."""
        local = int(self.local_index[expert])
        if local < 0:
            return False
        target, shard = EXPERT_PROJECTIONS[projection]
        getattr(self, target).load_shard(param_name, tensor, local, shard)
        return True

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.apply_routing(x, *select_experts(router_logits, self.top_k, self.renormalize))

    def apply_routing(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts over a routing chosen by the caller — ``weights`` [T, top_k] (any float
        dtype) and expert ``ids`` [T, top_k] — for routers other than softmax top-k (DeepSeek's
        group-limited, biased sigmoid ones)."""
        local = self.local_index[ids.flatten()]  # one entry per (token, choice); -1: another rank
        order = torch.argsort(local, stable=True)
        if len(self.local_experts) < self.num_experts:
            order = order[int((local < 0).sum()) :]  # the other ranks' pairs sort first
        counts = torch.bincount(local[order], minlength=len(self.local_experts))
        segments = ExpertSegments.from_counts(counts)
        tokens = order // self.top_k
        hidden = self.activation(self.gate_up(x.index_select(0, tokens), segments))
        rows = self.down(hidden, segments)
        rows = rows * weights.flatten()[order, None].to(rows.dtype)
        out = torch.zeros_like(x).index_add_(0, tokens, rows)
        return self.group.all_reduce(out) if self.split and self.reduce_results else out

    def with_shared(self, routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """This layer's output (built with ``reduce_results=False``) plus a shared expert's
        partial one (a ``GatedMLP`` built so too), in one all-reduce of their sum where the
        experts are split; where they are whole, the shared expert's part alone is reduced."""
        if self.split:
            return self.group.all_reduce(routed + shared)
        return routed + self.group.all_reduce(shared)
