"""The conformance kit catches what it claims to: a backend that memoizes per-step work across
layers fails the model contract (and a one-layer example config, with which it would pass, is
refused), and one that assumes contiguous q fails the attention contract."""

from __future__ import annotations

import pytest
import torch

from engine.interfaces import AttentionSpec
from engine.plugins import add_plugin, load_plugins
from engine.testing import reference
from engine.testing.attention import BATCHES, run_two_calls
from engine.testing.models import ModelContract
from engine_models_llama.model import LlamaForCausalLM
from tests.plugins import faulty_attention

add_plugin(faulty_attention, "test-faulty-attention")

TINY = dict(
    model_type="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


class FirstLayerCacheContract(ModelContract):
    model_class = "engine_models_llama.model:LlamaForCausalLM"
    attention_backend = "test-first-layer-cache"
    platform = "cpu"
    new_tokens = 4


def _checkpoint(tmp_path, layers: int):
    folder = str(tmp_path / f"layers-{layers}")
    return {
        f"{layers} layers": (
            folder,
            reference.tiny_checkpoint(folder, "LlamaForCausalLM", dict(TINY, num_hidden_layers=layers)),
        )
    }


def test_a_backend_memoizing_across_layers_fails_with_two_layers_only(tmp_path):
    contract = FirstLayerCacheContract()
    contract.test_logprobs_and_greedy_match_transformers(_checkpoint(tmp_path, 1))  # passes by luck
    with pytest.raises(AssertionError):
        contract.test_logprobs_and_greedy_match_transformers(_checkpoint(tmp_path, 2))


class OneLayerLlama(LlamaForCausalLM):
    @classmethod
    def example_configs(cls):
        return {arch: dict(TINY, num_hidden_layers=1) for arch in cls.architectures}


def test_a_one_layer_example_config_is_refused():
    with pytest.raises(AssertionError, match="num_hidden_layers >= 2"):
        ModelContract().test_declares_example_configs(OneLayerLlama)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_backend_assuming_contiguous_q_fails_the_attention_contract(dtype):
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype, block_size=8)
    platform = load_plugins().get("platforms", "cpu")()
    backend = load_plugins().get("attention_backends", "test-contiguous-q")(spec, platform)
    results = run_two_calls(backend, spec, BATCHES["mixed"], num_blocks=64)
    assert not all(torch.allclose(out.double(), expected, atol=3e-2, rtol=3e-2) for out, expected in results)


def test_a_backend_memoizing_across_layers_fails_the_attention_contract():
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float32, block_size=8)
    platform = load_plugins().get("platforms", "cpu")()
    backend = load_plugins().get("attention_backends", "test-first-layer-cache")(spec, platform)

    def passes(layers: int) -> bool:
        results = run_two_calls(backend, spec, BATCHES["mixed"], num_blocks=64, num_layers=layers)
        return all(torch.allclose(out.double(), expected, atol=2e-4, rtol=2e-4) for out, expected in results)

    assert passes(1) and not passes(3)
