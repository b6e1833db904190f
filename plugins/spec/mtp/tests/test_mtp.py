"""spec-mtp on tiny random DeepSeek-V3 checkpoints that carry an MTP module as a real V3
checkpoint does (``model.layers.<num_hidden_layers>.*``): greedy exactness under the drafter
contract (batched, chunked prefill, preemption, penalties), the module's forward against the
formula in plain torch (its decoder block: transformers' own layer), full acceptance where the
module provably predicts what the target will, and refusals by name."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.testing import reference
from engine.testing.spec import OPTIONS, TINY, DrafterContract

MAIN_LAYERS = 1  # dense (first_k_dense_replace); the MTP block, past it, routes experts
V3 = dict(
    model_type="deepseek_v3",
    vocab_size=TINY["vocab_size"],
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=256,
    first_k_dense_replace=1,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_interleave=True,
    tie_word_embeddings=False,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=5000.0,
        factor=4.0,
        original_max_position_embeddings=64,
        beta_fast=32,
        beta_slow=1,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
)
MTP = f"model.layers.{MAIN_LAYERS}."


def write_v3_with_mtp(folder: str, seed: int = 0, predicts_target: bool = False):
    """A random V3 of ``MAIN_LAYERS`` layers whose MTP block is a further random layer of the same
    transformers model (saved with it, then cut off by the config), plus random ``enorm``,
    ``hnorm``, ``eh_proj``, ``shared_head`` and the copy of the embeddings V3 keeps there.
    -> the transformers model of all the layers (its last is the MTP block).

    ``predicts_target``: every attention and MLP output is zeroed, so the target's next token
    depends on the current token only (h_i = norm(embed(t_i))), and the MTP module is made to
    compute the same from embed(t_{i+1}) (``eh_proj`` takes the embedding half; its block adds
    nothing; its norm is the final norm, and without ``shared_head.head`` in the checkpoint its
    head is the main LM head): it predicts t_{i+2} exactly."""
    full = reference.tiny_checkpoint(
        folder, "DeepseekV3ForCausalLM", {**V3, "num_hidden_layers": MAIN_LAYERS + 1}, seed
    )
    file = Path(folder) / "model.safetensors"
    tensors = load_file(str(file))
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = V3["hidden_size"]

    def around_one(size):
        return 1 + torch.rand(size, generator=gen) * 0.5 - 0.25

    tensors |= {
        MTP + "enorm.weight": around_one(hidden),
        MTP + "hnorm.weight": around_one(hidden),
        MTP + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) * 0.1,
        MTP + "shared_head.norm.weight": around_one(hidden),
        MTP + "shared_head.head.weight": torch.randn(V3["vocab_size"], hidden, generator=gen),
        MTP + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    }
    if predicts_target:
        for name in tensors:
            if "o_proj" in name or "down_proj" in name:
                tensors[name] = torch.zeros_like(tensors[name])
        tensors[MTP + "enorm.weight"] = torch.ones(hidden)
        tensors[MTP + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
        tensors[MTP + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
        del tensors[MTP + "shared_head.head.weight"]  # the module takes the main LM head then
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((Path(folder) / "config.json").read_text())
    (Path(folder) / "config.json").write_text(
        json.dumps({**config, "num_hidden_layers": MAIN_LAYERS, "num_nextn_predict_layers": 1})
    )
    return full


@pytest.fixture(scope="module")
def v3_mtp(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("v3-mtp"))
    return folder, write_v3_with_mtp(folder, seed=5)


class TestMTPDrafter(DrafterContract):
    speculative_config = {"method": "deepseek_mtp", "num_speculative_tokens": 2}

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, v3_mtp):
        return v3_mtp[0]


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_forward_matches_the_formula(v3_mtp):
    """Prefill rows t_1..t_{P-1} at positions 0..P-2 beside the target's h_0..h_{P-2}: the
    module's logits against eh_proj([enorm(e) ; hnorm(h)]) -> transformers' layer -> shared head."""
    from engine import LLM

    folder, full = v3_mtp
    llm = LLM(
        folder, **OPTIONS, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 2}
    )
    drafter = llm.engine.speculator.drafter
    prompt = reference.random_prompts(V3["vocab_size"], [13], seed=3)[0]
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    eps = full.config.rms_norm_eps
    with torch.no_grad():
        ids = torch.tensor([prompt])
        main = full.model.embed_tokens(ids)
        positions = torch.arange(len(prompt)).unsqueeze(0)
        cos_sin = full.model.rotary_emb(main, positions)
        causal = torch.full((len(prompt), len(prompt)), float("-inf")).triu(1)[None, None]
        for layer in full.model.layers[:MAIN_LAYERS]:
            main = layer(main, attention_mask=causal, position_embeddings=cos_sin)
        h = full.model.norm(main)[0, :-1]
        e = full.model.embed_tokens(ids)[0, 1:].clone()
        e[0] = 0  # the row at position 0
        x = torch.cat(
            [rms(e, tensors[MTP + "enorm.weight"], eps), rms(h, tensors[MTP + "hnorm.weight"], eps)], -1
        )
        x = x @ tensors[MTP + "eh_proj.weight"].T
        rows = len(prompt) - 1
        block_cos_sin = full.model.rotary_emb(x[None], positions[:, :rows])
        out = full.model.layers[MAIN_LAYERS](
            x[None], attention_mask=causal[..., :rows, :rows], position_embeddings=block_cos_sin
        )[0]
        expected = (
            rms(out, tensors[MTP + "shared_head.norm.weight"], eps)
            @ tensors[MTP + "shared_head.head.weight"].T
        )

    from engine.runner.drafting import Chunk

    blocks = list(range(-(-rows // OPTIONS["block_size"])))
    hidden, _, _ = drafter._step([Chunk(prompt[1:], 0, blocks)], [h.float()], 0)
    got = drafter.model.compute_logits(hidden)
    torch.testing.assert_close(got, expected.float(), atol=2e-4, rtol=2e-4)


def test_acceptance_where_the_module_predicts_the_target(tmp_path):
    from engine import LLM, SamplingParams

    write_v3_with_mtp(str(tmp_path), seed=7, predicts_target=True)
    llm = LLM(
        str(tmp_path),
        **OPTIONS,
        device="cpu",
        speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 3},
    )
    prompts = reference.random_prompts(V3["vocab_size"], [6, 19, 11], seed=2)
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats["spec_draft_tokens"] > 0
    assert stats["spec_accepted_tokens"] >= 0.95 * stats["spec_draft_tokens"], stats


@pytest.mark.slow  # two mp worker starts and a one-rank engine
def test_two_ranks_draft_greedy_exact_with_a_tensor_parallel_target(tmp_path):
    """TP=2 (mp, gloo): the DeepSeek-V3 target split by heads and expert slices, the MTP module
    whole on both ranks, drafting on each (the embedding is vocabulary-parallel). Greedy tokens
    with a random module equal one rank's without speculation; where the module predicts the
    target, nearly every draft is accepted at TP=2 too."""
    from engine import LLM, SamplingParams

    tp2 = dict(OPTIONS, device="cpu", tensor_parallel_size=2, distributed_executor_backend="mp")
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 2}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = reference.random_prompts(V3["vocab_size"], [6, 19, 11, 30], seed=2)
    for predicts in (False, True):
        folder = tmp_path / f"predicts-{predicts}"
        write_v3_with_mtp(str(folder), seed=9, predicts_target=predicts)
        baseline = LLM(str(folder), **OPTIONS, device="cpu")
        try:
            expected = [o.outputs[0].token_ids for o in baseline.generate(prompts, params)]
        finally:
            baseline.engine.shutdown()
        llm = LLM(str(folder), **tp2, speculative_config=spec)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            stats = llm.engine.stats()
        finally:
            llm.engine.shutdown()
        assert got == expected, f"predicts_target={predicts}: TP=2 with MTP must equal one rank without"
        assert stats["spec_draft_tokens"] > 0
        if predicts:
            assert stats["spec_accepted_tokens"] >= 0.95 * stats["spec_draft_tokens"], stats
        accepted, drafted = stats["spec_accepted_tokens"], stats["spec_draft_tokens"]
        print(f"predicts_target={predicts}: accepted {accepted} of {drafted}")


@pytest.mark.parametrize("case", ["llama", "no-mtp-layers", "no-mtp-weights"])
def test_refused_without_an_mtp_module(tmp_path, case):
    from engine import LLM

    if case == "llama":
        reference.tiny_checkpoint(str(tmp_path), "LlamaForCausalLM", TINY)
        match = (
            r"method 'deepseek_mtp' needs a checkpoint with a multi-token-prediction module; LlamaForCausalLM"
        )
    else:  # transformers' V3 config says one MTP layer by default, and saves none
        layers = 0 if case == "no-mtp-layers" else 1
        reference.tiny_checkpoint(
            str(tmp_path),
            "DeepseekV3ForCausalLM",
            {**V3, "num_hidden_layers": MAIN_LAYERS, "num_nextn_predict_layers": layers},
        )
        match = (
            r"num_nextn_predict_layers 0\) has none"
            if layers == 0
            else rf"has no multi-token-prediction weights \(model\.layers\.{MAIN_LAYERS}\.\* \.\.\.\)"
        )
    with pytest.raises(ValueError, match=match):
        LLM(
            str(tmp_path),
            **OPTIONS,
            speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2},
        )
