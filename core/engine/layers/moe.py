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

Expert parallelism: a layer is told which experts live on this rank (``local_experts``,
default all). It stores only those, and routing drops the (token, expert) pairs of the
others, so each rank's output is its experts' share of the sum; the executor all-reduces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from engine.layers.batch_invariant import ROWS, in_row_tiles
from engine.layers.experts import ExpertSegments
from engine.layers.linear import Linear
from engine.layers.module import Layer
from engine.layers.unquantized import UnquantizedLinearMethod

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


class ExpertLinear(Layer):
    """One projection of every local expert, [E, sum(output_sizes), input_size], stored and
    multiplied by the quant method (its ``*_moe_*`` methods); checkpoint tensors arrive one
    expert and shard at a time through :meth:`load_shard`. With ``bias`` each expert has a bias
    [E, sum(output_sizes)] in the activation dtype (whatever the method), loaded as ``bias``."""

    def __init__(
        self,
        num_experts: int,
        input_size: int,
        output_sizes: list[int],
        method,
        dtype: torch.dtype,
        bias: bool = False,
    ):
        super().__init__()
        if not method.quantizes_experts:
            method = UnquantizedLinearMethod(method.ctx)
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
        the parameter's ``expert_weight_loader(param, tensor, expert, shard)``)."""
        param = getattr(self, param_name)
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
    projections per-expert biases (checkpoint ``<e>.<projection>.bias``)."""

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
    ):
        super().__init__()
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
        self.gate_up = ExpertLinear(
            len(self.local_experts), hidden_size, [intermediate_size] * 2, method, dtype, bias
        )
        self.down = ExpertLinear(
            len(self.local_experts), intermediate_size, [hidden_size], method, dtype, bias
        )

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
        return torch.zeros_like(x).index_add_(0, tokens, rows)
