"""DeepSeek on two tensor-parallel ranks: MLA split by heads (query and ``kv_b_proj`` rows,
``o_proj`` columns; the latent projection, its norm and the rotary key replicated, so both ranks
cache the same latent pages), dense first layers and shared experts as dense MLPs, routed experts
by intermediate slice. Each rank holds half the experts' bytes, and (``mp``, gloo, the torch MLA
backend) greedy tokens equal transformers' for V2-Lite (no query low rank), V2 (query low rank,
grouped routing, YaRN) and V3 (sigmoid biased routing)."""

from __future__ import annotations

import pytest

from engine.testing.models import expert_bytes_per_rank, tensor_parallel_greedy_matches_transformers
from engine_models_deepseek.model import DeepseekForCausalLM

ARCHITECTURES = list(DeepseekForCausalLM.example_configs())


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_each_rank_holds_half_of_every_expert(architecture):
    whole, ranks = expert_bytes_per_rank(DeepseekForCausalLM, architecture)
    assert whole > 0 and ranks == [whole // 2, whole // 2]


@pytest.mark.slow  # a worker process's start and a second engine
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_two_ranks_give_transformers_greedy_tokens(architecture, tmp_path):
    tensor_parallel_greedy_matches_transformers(DeepseekForCausalLM, architecture, str(tmp_path))
