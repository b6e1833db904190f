"""Phi-3's own parts beside the contract: LongRoPE's tables past ``original_max_position_embeddings``
(the contract's sequences stay within it) against transformers' rotary on a sequence that long,
and the fused checkpoint projections loaded on two tensor-parallel ranks, each cutting its rows
of q, k, v, gate and up out of ``qkv_proj`` and ``gate_up_proj``."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from engine.layers import RotaryEmbedding
from engine.testing.models import tensor_parallel_greedy_matches_transformers
from engine_models_phi3.model import Phi3ForCausalLM


def _config(name: str):
    kwargs = dict(Phi3ForCausalLM.example_configs()[name])
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def test_longrope_tables_take_the_long_factors_past_the_original_length():
    cfg = _config("Phi3ForCausalLM")
    original = cfg.rope_parameters["original_max_position_embeddings"]
    ours = RotaryEmbedding(cfg, cfg.max_position_embeddings, torch.float32)
    hf = Phi3RotaryEmbedding(cfg)
    probe = torch.zeros(1)
    short_cos, short_sin = hf(probe, torch.arange(original)[None])
    long_cos, long_sin = hf(probe, torch.arange(original + 40)[None])
    assert ours.cos.shape[-1] == cfg.hidden_size // cfg.num_attention_heads // 2  # partial_rotary_factor
    torch.testing.assert_close(ours.cos[:original], short_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin[:original, -short_sin.shape[-1] // 2 :], short_sin[0, :, 4:])
    torch.testing.assert_close(ours.cos[original : original + 40], long_cos[0, original:], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin[original : original + 40, 4:], long_sin[0, original:, 4:])
    assert not torch.allclose(short_cos[0, 1:], long_cos[0, 1:original])  # the two sets differ


@pytest.mark.slow  # a worker process's start and a second engine
def test_tensor_parallel_ranks_cut_the_fused_projections(tmp_path):
    tensor_parallel_greedy_matches_transformers(Phi3ForCausalLM, "Phi3ForCausalLM", str(tmp_path))
