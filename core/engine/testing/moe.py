"""Mixture-of-experts checks: a plain-math reference for :class:`engine.layers.FusedMoE` (a loop
over experts, each taking the tokens that chose it) and a builder of a loaded layer, which
quant-method tests use to check ``apply_moe`` against ``dequantize_moe``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def reference_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
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


def loaded_moe(
    method,
    num_experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    renormalize: bool,
    checkpoint_tensors: Callable[[torch.Tensor], tuple[list[tuple[str, object]], torch.Tensor]] | None = None,
    local_experts=None,
    seed: int = 0,
    reduce_results: bool = True,
):
    """A :class:`FusedMoE` through ``method`` with random experts loaded one (expert, shard) at
    a time, as a checkpoint would -> (layer, (gate_up [E, 2I, H], down [E, H, I]) the float32
    originals, the same two as the loaded tensors represent by the format's plain math).
    ``checkpoint_tensors(weight)`` is how a format stores one expert's projection: the
    (parameter, tensor) pairs to load and the weight they represent (default: the weight in
    the method's dtype). ``reduce_results=False``: a tensor-parallel rank's layer returns its
    partial sum."""
    from engine.layers import FusedMoE, LayerOps

    gen = torch.Generator().manual_seed(seed)
    dtype = method.ctx.dtype
    layer = FusedMoE(
        num_experts,
        top_k,
        hidden,
        intermediate,
        renormalize,
        method,
        dtype,
        LayerOps(),
        local_experts=local_experts,
        reduce_results=reduce_results,
    )
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(num_experts, hidden, intermediate, generator=gen) * intermediate**-0.5
    to_tensors = checkpoint_tensors or (lambda weight: ([("weight", weight.to(dtype))], weight.to(dtype)))
    represented: dict[str, list[torch.Tensor]] = {"w1": [], "w3": [], "w2": []}
    for expert in range(num_experts):
        gate, up = gate_up[expert].chunk(2)
        for projection, weight in (("w1", gate), ("w3", up), ("w2", down[expert])):
            pairs, plain = to_tensors(weight.contiguous())
            for name, tensor in pairs:
                layer.load_expert(projection, name, expert, tensor)
            represented[projection].append(plain.float())
    for part in (layer.gate_up, layer.down):
        part.process_weights_after_loading()
    plain_gate_up = torch.cat([torch.stack(represented["w1"]), torch.stack(represented["w3"])], dim=1)
    return layer, (gate_up, down), (plain_gate_up, torch.stack(represented["w2"]))
