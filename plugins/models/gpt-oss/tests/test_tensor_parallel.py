"""gpt-oss on two tensor-parallel ranks (``mp``, gloo): each rank attends its KV-head group with
its own heads' sinks, over alternating windowed layers, and runs its intermediate slice of every
expert (biased, clamped SwiGLU), all-reduced; greedy tokens equal transformers'."""

from __future__ import annotations

import pytest

from engine.testing.models import tensor_parallel_greedy_matches_transformers
from engine_models_gpt_oss.model import GptOssForCausalLM


@pytest.mark.slow  # a worker process's start and a second engine
def test_two_ranks_give_transformers_greedy_tokens(tmp_path):
    tensor_parallel_greedy_matches_transformers(GptOssForCausalLM, "GptOssForCausalLM", str(tmp_path))
