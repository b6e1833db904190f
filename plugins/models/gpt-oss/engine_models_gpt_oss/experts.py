"""gpt-oss's mixture of experts: its router, its clamped SwiGLU, and its checkpoint layout.

The router is a biased linear whose top-k logits are softmaxed (after the choice, not before).
Each expert computes ``gate_up = x·W + b`` and ``(clamp(up, ±limit) + 1) · g · σ(α·g)`` with
``g = clamp(gate, max=limit)``, then a biased down projection (``GptOssExperts``).

Checkpoints store every expert of a layer in one tensor, gate and up interleaved along the
projection's output (gate the even, up the odd entries): in float, ``gate_up_proj`` [E, H, 2·I]
and ``down_proj`` [E, I, H], transposed against a linear weight; with MXFP4 experts,
``gate_up_proj_blocks`` [E, 2·I, H/32, 16] and ``gate_up_proj_scales`` [E, 2·I, H/32] (and the
same for ``down_proj``), in a linear weight's orientation. :func:`per_expert_tensors` splits them
into the per-expert ``gate_proj`` / ``up_proj`` / ``down_proj`` tensors the core's
:class:`engine.layers.FusedMoE` loads, so the experts keep the quant method's storage (MXFP4
stays packed) and the core's grouped matmul.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.layers import FusedMoE, Layer, LayerOps, router_linear
from engine.layers.checkpoint import materialize

# the stacked checkpoint tensors of a layer's experts: suffix -> (per-expert parameter, whether
# gate and up are interleaved in it, whether it is transposed against a linear weight)
STACKED = {
    "gate_up_proj": ("weight", True, True),
    "gate_up_proj_bias": ("bias", True, False),
    "gate_up_proj_blocks": ("weight_blocks", True, False),
    "gate_up_proj_scales": ("weight_scales", True, False),
    "down_proj": ("weight", False, True),
    "down_proj_bias": ("bias", False, False),
    "down_proj_blocks": ("weight_blocks", False, False),
    "down_proj_scales": ("weight_scales", False, False),
}


class ClampedSwiGLU:
    """gpt-oss's expert activation on [gate | up] rows (the halves, de-interleaved on load)."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]): the ``top_k`` largest logits, softmaxed among
    themselves in the logits' dtype, as ``GptOssTopKRouter`` does."""
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids


class GptOssMoE(Layer):
    """``router`` (biased, unquantized) and ``experts`` (the core's FusedMoE with biases and the
    clamped SwiGLU; their weights in the quant method's storage)."""

    def __init__(self, cfg, method, dtype, ops: LayerOps):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = router_linear(cfg.hidden_size, cfg.num_local_experts, method, dtype, bias=True)
        self.experts = FusedMoE(
            cfg.num_local_experts,
            cfg.num_experts_per_tok,
            cfg.hidden_size,
            cfg.intermediate_size,
            False,
            method,
            dtype,
            ops,
            activation=ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit),
            bias=True,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.apply_routing(x, *route(self.router(x), self.top_k))


def per_expert_tensors(
    weights: Iterable[tuple[str, object]],
) -> Iterator[tuple[str, object]]:
    """``weights`` with each stacked expert tensor (:data:`STACKED`) split into
    ``<experts>.<e>.{gate,up,down}_proj.<param>`` in a linear weight's [out, in] orientation;
    every other tensor passes through untouched (and unread)."""
    for name, tensor in weights:
        prefix, _, suffix = name.rpartition(".")
        if suffix not in STACKED or not prefix.endswith(".experts"):
            yield name, tensor
            continue
        param, interleaved, transposed = STACKED[suffix]
        stacked = materialize(tensor)
        for expert, one in enumerate(stacked):
            one = one.t() if transposed else one
            if interleaved:
                yield f"{prefix}.{expert}.gate_proj.{param}", one[0::2].contiguous()
                yield f"{prefix}.{expert}.up_proj.{param}", one[1::2].contiguous()
            else:
                yield f"{prefix}.{expert}.down_proj.{param}", one.contiguous()
