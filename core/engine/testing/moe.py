"""Mixture-of-experts checks: a plain-math reference for :class:`engine.layers.FusedMoE` (a loop
over experts, each taking the tokens that chose it) and a builder of a loaded layer, which
quant-method tests use to check ``apply_moe`` against ``dequantize_moe``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def reference_moe(x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  top_k: int, renormalize: bool) -> torch.Tensor:
    """x [T, H], router_logits [T, E], gate_up [E, 2I, H], down [E, H, I] -> [T, H] in float32:
    softmax, top-k (renormalized if asked), and for each expert the SwiGLU of the tokens that
    chose it, weighted and summed."""
    x = x.float()
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        token, choice = torch.where(ids == expert)
        if not token.numel():
            continue
        gate, up = F.linear(x[token], gate_up[expert].float()).chunk(2, dim=-1)
        rows = F.linear(F.silu(gate) * up, down[expert].float())
        out.index_add_(0, token, rows * weights[token, choice, None])
    return out


def loaded_moe(method, num_experts: int, top_k: int, hidden: int, intermediate: int, renormalize: bool,
               checkpoint_tensors: Callable[[torch.Tensor], list[tuple[str, object]]] | None = None,
               local_experts=None, seed: int = 0):
    """A :class:`FusedMoE` through ``method`` with random experts loaded one (expert, shard) at
    a time, as a checkpoint would -> (layer, gate_up [E, 2I, H], down [E, H, I]) float32
    originals. ``checkpoint_tensors(weight)`` gives the (parameter, tensor) pairs a format
    stores for one expert's projection (default: the float weight)."""
    from engine.layers import FusedMoE, LayerOps

    gen = torch.Generator().manual_seed(seed)
    layer = FusedMoE(num_experts, top_k, hidden, intermediate, renormalize, method, method.ctx.dtype, LayerOps(),
                     local_experts=local_experts)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * hidden ** -0.5
    down = torch.randn(num_experts, hidden, intermediate, generator=gen) * intermediate ** -0.5
    to_tensors = checkpoint_tensors or (lambda weight: [("weight", weight.to(method.ctx.dtype))])
    for expert in range(num_experts):
        gate, up = gate_up[expert].chunk(2)
        for projection, weight in (("w1", gate), ("w3", up), ("w2", down[expert])):
            for name, tensor in to_tensors(weight.contiguous()):
                layer.load_expert(projection, name, expert, tensor)
    for part in (layer.gate_up, layer.down):
        part.process_weights_after_loading()
    return layer, gate_up, down
