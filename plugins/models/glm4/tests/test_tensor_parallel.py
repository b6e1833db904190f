"""GLM-4 on two tensor-parallel ranks (``mp``): each cuts its rows of gate and up out of the
checkpoint's fused ``gate_up_proj`` and rotates its own heads' interleaved pairs; greedy
tokens equal transformers'."""

from __future__ import annotations

import pytest

from engine.testing.models import tensor_parallel_greedy_matches_transformers
from engine_models_glm4.model import Glm4ForCausalLM


@pytest.mark.slow  # a worker process's start and a second engine
def test_two_ranks_give_transformers_greedy_tokens(tmp_path):
    tensor_parallel_greedy_matches_transformers(Glm4ForCausalLM, "Glm4ForCausalLM", str(tmp_path))
