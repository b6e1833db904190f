"""The MoE decoders on two tensor-parallel ranks: every expert split by intermediate slice (gate
and up rows, down columns; the router replicated), Qwen2-MoE's shared expert and the dense
layers as dense MLPs. Each rank holds half the experts' bytes, and (``mp``, gloo) greedy
tokens equal transformers'."""

from __future__ import annotations

import pytest

from engine.testing.models import expert_bytes_per_rank, tensor_parallel_greedy_matches_transformers
from engine_models_moe.model import MoeForCausalLM

# a shared expert and QKV bias; per-head q/k norms and a dense layer among sparse ones
ARCHITECTURES = ["Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]


@pytest.mark.parametrize("architecture", [*ARCHITECTURES, "MixtralForCausalLM"])
def test_each_rank_holds_half_of_every_expert(architecture):
    whole, ranks = expert_bytes_per_rank(MoeForCausalLM, architecture)
    assert whole > 0 and ranks == [whole // 2, whole // 2]


@pytest.mark.slow  # a worker process's start and a second engine
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_two_ranks_give_transformers_greedy_tokens(architecture, tmp_path):
    tensor_parallel_greedy_matches_transformers(MoeForCausalLM, architecture, str(tmp_path))
