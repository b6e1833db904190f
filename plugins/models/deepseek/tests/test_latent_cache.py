"""The latent cache as the engine runs a DeepSeek model: the cpu-native platform attends it with
the C kernel (mla-cpu-native); decode goes through the absorbed path, in C and in torch, and agrees
with the naive one forced on it; the pool is sized at the latent's bytes per token;
without a backend that reads the layout the model is refused naming it."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core import kv_sizing
from engine.testing import reference
from engine_models_deepseek.model import DeepseekForCausalLM

CONFIG = DeepseekForCausalLM.example_configs()["DeepseekV3ForCausalLM"]
LAYERS, ENTRY = CONFIG["num_hidden_layers"], CONFIG["kv_lora_rank"] + CONFIG["qk_rope_head_dim"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("deepseek-v3"))
    model = reference.tiny_checkpoint(folder, "DeepseekV3ForCausalLM", CONFIG)
    reference.randomize_norms(model, folder, also=("e_score_correction_bias",))
    return folder


def _generate(llm: LLM, prompts):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    return llm.generate(prompts, params)


def test_the_cpu_native_platform_attends_the_latent_in_c(checkpoint):
    llm = LLM(checkpoint, dtype="float32", num_blocks=40)
    assert llm.engine.platform.name == "cpu-native"
    assert llm.engine.attention.name == "mla-cpu-native"


@pytest.mark.parametrize("backend_name", ["mla-cpu-native", "mla-torch"])
def test_decode_runs_absorbed_and_equals_the_naive_path(checkpoint, backend_name):
    llm = LLM(checkpoint, dtype="float32", num_blocks=64, block_size=8, attention_backend=backend_name)
    backend = llm.engine.attention
    assert backend.name == backend_name
    prompts = reference.random_prompts(CONFIG["vocab_size"], [6, 19, 11], seed=3)
    absorbed = _generate(llm, prompts)
    assert backend.path_rows["absorbed"] >= 3 * 7, backend.path_rows  # every decoded token
    backend.decode_path = "naive"
    rows = dict(backend.path_rows)
    naive = _generate(llm, prompts)
    assert backend.path_rows["absorbed"] == rows["absorbed"]
    for a, n in zip(absorbed, naive):
        assert a.outputs[0].token_ids == n.outputs[0].token_ids
        for got, want in zip(a.outputs[0].logprobs, n.outputs[0].logprobs):
            token = next(iter(got))
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)


def test_pool_is_sized_at_the_latent_bytes_per_token(checkpoint, caplog):
    block_size, blocks = 16, 40
    per_block = LAYERS * block_size * ENTRY * 4  # float32
    budget = blocks * per_block + per_block // 2  # half a block over: it stays unused
    with caplog.at_level(logging.INFO, logger="engine"):
        llm = LLM(checkpoint, dtype="float32", block_size=block_size, kv_cache_memory=budget)
    assert f"({blocks} blocks of {block_size} tokens, {LAYERS * ENTRY * 4} bytes per token)" in caplog.text
    engine = llm.engine
    assert engine.num_blocks == blocks
    assert kv_sizing.kv_bytes_per_token(engine.layer_attention, block_size) == LAYERS * ENTRY * 4
    assert [tuple(c.shape) for c in engine.runner.kv_caches] == [(blocks, block_size, ENTRY)] * LAYERS


def test_refused_naming_the_layout_without_a_latent_backend(checkpoint):
    with pytest.raises(RuntimeError) as error:
        LLM(checkpoint, dtype="float32", num_blocks=16, plugins=["models-deepseek", "attention-torch"])
    message = str(error.value)
    assert "\n" not in message
    assert "no attention backend can run here" in message and "paged-latent cache layout" in message


def test_multi_token_prediction_layers_are_skipped_when_loading(checkpoint):
    """V3 checkpoints carry the MTP module as layer ``num_hidden_layers``: a drafter's, not this
    model's; everything else loads as before."""
    from safetensors.torch import load_file

    llm = LLM(checkpoint, dtype="float32", num_blocks=40)
    weights = load_file(f"{checkpoint}/model.safetensors")
    mtp = {f"model.layers.{LAYERS}.{name}": torch.ones(2) for name in ("eh_proj.weight", "enorm.weight")}
    llm.engine.model.load_weights([*weights.items(), *mtp.items()])
    loaded = llm.engine.model.model.layers[1].self_attn.kv_b_proj.weight
    torch.testing.assert_close(loaded, weights["model.layers.1.self_attn.kv_b_proj.weight"])


def test_speculative_verification_is_exact_on_the_latent_cache(checkpoint):
    """n-gram drafts verified as multi-row chunks after a cached prefix (the naive path, with
    a mask): greedy tokens equal those decoded one at a time (the absorbed path)."""
    prompts = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 7 + [40]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = LLM(checkpoint, dtype="float32", num_blocks=64, block_size=8).generate(prompts, params)
    spec = LLM(
        checkpoint,
        dtype="float32",
        num_blocks=64,
        block_size=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    drafted = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    rows = spec.engine.attention.path_rows
    assert rows["naive"] > sum(len(p) for p in prompts), rows  # verified drafts beside the prompts
