"""DeepSeek's MoE routers: which experts each token goes to, and with what weight.

V2 scores experts with a softmax and takes the top-k, greedily or within the ``topk_group``
best of ``n_group`` expert groups (a group's score: its best expert); weights are the scores,
times ``routed_scaling_factor``. V3 scores with a sigmoid, chooses with the scores plus a
per-expert ``e_score_correction_bias`` (load balancing without an auxiliary loss) within the
best groups (a group's score: the sum of its two best), weighs with the unbiased scores,
renormalized when ``norm_topk_prob``, times ``routed_scaling_factor``. As in Hugging Face's
code, all in float32 with the router's weight kept in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import Layer


def group_mask(scores: torch.Tensor, n_group: int, topk_group: int, group_score) -> torch.Tensor:
    """[T, E] True for the experts in each token's ``topk_group`` best groups, a group's score
    ``group_score(scores of its experts [T, G, E/G]) -> [T, G]``."""
    tokens, experts = scores.shape
    groups = group_score(scores.view(tokens, n_group, experts // n_group))
    chosen = torch.zeros_like(groups).scatter_(1, torch.topk(groups, topk_group, dim=-1, sorted=False)[1], 1)
    return chosen.bool().repeat_interleave(experts // n_group, dim=1)


class DeepseekRouter(Layer):
    """The router's weight [E, hidden] (and V3's ``e_score_correction_bias``), both float32."""

    def __init__(self, cfg, num_experts: int, v3: bool):
        super().__init__()
        self.v3, self.top_k = v3, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.scaling = cfg.routed_scaling_factor
        self.grouped = v3 or getattr(cfg, "topk_method", "greedy") == "group_limited_greedy"
        self.renormalize = v3 and cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, cfg.hidden_size), requires_grad=False)
        if v3:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights float32 [T, top_k], expert ids [T, top_k])."""
        logits = F.linear(x.float(), self.weight.float())
        return self._v3(logits) if self.v3 else self._v2(logits)

    def _v2(self, logits: torch.Tensor):
        scores = logits.softmax(dim=-1)
        if self.grouped:
            keep = group_mask(scores, self.n_group, self.topk_group, lambda g: g.max(dim=-1).values)
            scores = scores.masked_fill(~keep, 0.0)
        weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        return weights * self.scaling, ids

    def _v3(self, logits: torch.Tensor):
        scores = logits.sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        keep = group_mask(biased, self.n_group, self.topk_group, lambda g: g.topk(2, dim=-1)[0].sum(dim=-1))
        ids = torch.topk(biased.masked_fill(~keep, float("-inf")), self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids
