"""Granite on two tensor-parallel ranks (``mp``): each rank scales its own heads' queries by
the attention multiplier and the reduced block outputs by the residual multiplier; greedy
tokens equal transformers'."""

from __future__ import annotations

import pytest

from engine.testing.models import tensor_parallel_greedy_matches_transformers
from engine_models_granite.model import GraniteForCausalLM


@pytest.mark.slow  # a worker process's start and a second engine
def test_two_ranks_give_transformers_greedy_tokens(tmp_path):
    tensor_parallel_greedy_matches_transformers(GraniteForCausalLM, "GraniteForCausalLM", str(tmp_path))
