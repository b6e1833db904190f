"""spec-eagle with a randomly initialised head written in the published EAGLE layout:
greedy exactness under the drafter contract (exactness does not depend on acceptance)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.testing.spec import TINY, DrafterContract


def write_random_eagle_head(folder, hidden=64, heads=4, kv_heads=2, inter=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    tensors = {
        "fc.weight": w(hidden, 2 * hidden),
        "fc.bias": w(hidden),
        "layers.0.self_attn.q_proj.weight": w(heads * head_dim, hidden),
        "layers.0.self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
        "layers.0.self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
        "layers.0.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": w(inter, hidden),
        "layers.0.mlp.up_proj.weight": w(inter, hidden),
        "layers.0.mlp.down_proj.weight": w(hidden, inter),
        "layers.0.post_attention_layernorm.weight": torch.ones(hidden),
        "embed_tokens.weight": w(TINY["vocab_size"], hidden),
    }
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "vocab_size": TINY["vocab_size"],
        "bias": True,
    }
    (folder / "config.json").write_text(json.dumps(config))


def write_random_eagle3_head(folder, hidden=64, heads=4, kv_heads=2, inter=128, draft_vocab=96, seed=1):
    gen = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    prefix = "midlayer."
    tensors = {
        "fc.weight": w(hidden, 3 * hidden),
        prefix + "self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
        prefix + "self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        prefix + "self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        prefix + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
        prefix + "mlp.gate_proj.weight": w(inter, hidden),
        prefix + "mlp.up_proj.weight": w(inter, hidden),
        prefix + "mlp.down_proj.weight": w(hidden, inter),
        prefix + "input_layernorm.weight": torch.ones(hidden),
        prefix + "hidden_norm.weight": torch.ones(hidden),
        prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": w(draft_vocab, hidden),
        # draft id i is target id 2 * i: d2t holds the offsets
        "d2t": torch.arange(draft_vocab) * 2 % TINY["vocab_size"] - torch.arange(draft_vocab),
        "t2d": torch.zeros(TINY["vocab_size"], dtype=torch.bool),
    }
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "vocab_size": TINY["vocab_size"],
        "draft_vocab_size": draft_vocab,
    }
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3")
    write_random_eagle3_head(folder)
    return str(folder)


def test_eagle3_drafts_map_through_d2t(eagle3_dir, tmp_path):
    from engine import LLM, SamplingParams
    from engine.testing import reference
    from engine.testing.spec import OPTIONS

    target = tmp_path / "t"
    reference.tiny_checkpoint(str(target), "LlamaForCausalLM", TINY)
    llm = LLM(
        str(target),
        **OPTIONS,
        speculative_config={"method": "eagle", "model": eagle3_dir, "num_speculative_tokens": 3},
    )
    drafter = llm.engine.speculator.drafter
    assert drafter.hidden_state_layers() == (0, 1, 2)  # low, middle, high of a 3-layer target
    seen = []
    propose = drafter.propose
    drafter.propose = lambda requests: [seen.extend(d.token_ids) or d for d in propose(requests)]
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert seen and all(t % 2 == 0 for t in seen), "EAGLE-3 drafts must be target ids (here even)"


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle")
    write_random_eagle_head(folder)
    return str(folder)


class TestEagleHeads(DrafterContract):
    """Both published layouts against the drafter contract."""

    speculative_config = {"method": "eagle", "num_speculative_tokens": 3}

    @pytest.fixture(autouse=True, params=["eagle_dir", "eagle3_dir"], ids=["eagle-1", "eagle-3"])
    def _head(self, request):
        self.head_dir = request.getfixturevalue(request.param)

    def config(self, model_dir):
        return {**self.speculative_config, "model": self.head_dir}


def test_missing_weights_are_reported(tmp_path, eagle_dir):
    from engine import LLM
    from engine.testing import reference
    from engine.testing.spec import OPTIONS

    target = tmp_path / "t"
    reference.tiny_checkpoint(str(target), "LlamaForCausalLM", TINY)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((Path(eagle_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match="no \\*.safetensors EAGLE weights"):
        LLM(str(target), **OPTIONS, speculative_config={"method": "eagle", "model": str(empty)})


TP_PROMPTS = [[5, 6, 7, 8] * 5, [9, 70, 3, 44, 12, 8, 101, 33, 60]]


@pytest.fixture(scope="module")
def tp_target(tmp_path_factory):
    """(a tiny target, its greedy tokens for TP_PROMPTS at one rank without speculation)."""
    from engine import LLM
    from engine.testing import reference
    from engine.testing.spec import OPTIONS

    folder = str(tmp_path_factory.mktemp("tp-target"))
    reference.tiny_checkpoint(folder, "LlamaForCausalLM", TINY)
    llm = LLM(folder, **OPTIONS)
    try:
        return folder, _greedy(llm, TP_PROMPTS)[0]
    finally:
        llm.engine.shutdown()


def _greedy(llm, prompts):
    """(each prompt's greedy tokens, every draft token rank 0's drafter proposed, in order)."""
    from engine import SamplingParams

    drafted: list[int] = []
    if llm.engine.speculator is not None:
        drafter = llm.engine.speculator.drafter
        propose = drafter.propose
        drafter.propose = lambda requests: [drafted.extend(d.token_ids) or d for d in propose(requests)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], drafted


@pytest.mark.parametrize("head", ["eagle_dir", "eagle3_dir"], ids=["eagle-1", "eagle-3"])
def test_tp2_eagle_drafts_and_outputs_equal_tp1(head, tp_target, request):
    """At TP=2 the head drafts on both ranks (the target's vocabulary-parallel embedding and,
    for EAGLE-1, LM head are collectives): greedy output equals TP=1 without speculation, and
    the drafts are the ones one rank's head proposes."""
    from engine import LLM
    from engine.testing.spec import OPTIONS

    folder, plain = tp_target
    spec = {"method": "eagle", "model": request.getfixturevalue(head), "num_speculative_tokens": 3}
    runs = []
    for tp in (1, 2):
        llm = LLM(folder, **OPTIONS, speculative_config=spec, tensor_parallel_size=tp)
        try:
            runs.append(_greedy(llm, TP_PROMPTS))
        finally:
            llm.engine.shutdown()
    (one, one_drafts), (two, two_drafts) = runs
    assert one == plain and two == plain
    assert two_drafts and two_drafts == one_drafts
