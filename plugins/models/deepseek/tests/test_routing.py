"""DeepSeek's routers against transformers' own on random tokens: V2's greedy and group-limited
softmax routing, V3's biased grouped sigmoid routing, and V3 as Kimi-K2 configures it (one group
of all experts, so no group limit)."""

from __future__ import annotations

import pytest
import torch

from engine_models_deepseek.routing import DeepseekRouter

COMMON = dict(hidden_size=32, num_experts_per_tok=3, n_routed_experts=16, moe_intermediate_size=8)
CASES = {
    "v2-greedy": ("deepseek_v2", dict(topk_method="greedy", routed_scaling_factor=1.0)),
    "v2-group-limited": (
        "deepseek_v2",
        dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5),
    ),
    "v3": ("deepseek_v3", dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    "v3-kimi-k2": (
        "deepseek_v3",
        dict(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.8),
    ),
    "v3-unnormalized": ("deepseek_v3", dict(n_group=8, topk_group=3, norm_topk_prob=False)),
}


def _hf_router(model_type: str, cfg):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    return (DeepseekV3TopkRouter if model_type == "deepseek_v3" else DeepseekV2TopkRouter)(cfg)


@pytest.mark.parametrize("case", sorted(CASES))
def test_router_matches_transformers(case):
    from transformers import AutoConfig

    model_type, options = CASES[case]
    cfg = AutoConfig.for_model(model_type, **COMMON, **options)
    gen = torch.Generator().manual_seed(0)
    hf = _hf_router(model_type, cfg)
    ours = DeepseekRouter(cfg, cfg.n_routed_experts, v3=model_type == "deepseek_v3")
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=gen))
        ours.weight.copy_(hf.weight)
        if model_type == "deepseek_v3":
            hf.e_score_correction_bias.copy_(torch.rand(cfg.n_routed_experts, generator=gen) - 0.5)
            ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
        x = torch.randn(64, cfg.hidden_size, generator=gen)
        _, want_weights, want_ids = hf(x)
        weights, ids = ours(x)
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order))
