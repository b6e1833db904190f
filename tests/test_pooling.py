"""The pooling runner offline: `LLM.embed` on decoders (Llama, Qwen2, Qwen3) used as embedding models
against `transformers`' last hidden state for each pooling type, normalised or not; many
prompts pooled in one step with their KV blocks freed; matryoshka `dimensions`; and the
refusals, each a ValueError naming the field before any work starts."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, PoolingParams, SamplingParams
from engine.testing import reference

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
LENGTHS = [5, 17, 30, 1, 9, 64, 12, 3]  # 64: the whole context (max_model_len), with nothing left to generate


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    out = {}
    for arch, model_type, extra in [
        ("LlamaForCausalLM", "llama", {}),
        ("Qwen2ForCausalLM", "qwen2", {}),
        ("Qwen3ForCausalLM", "qwen3", {"head_dim": 32}),
    ]:
        folder = str(tmp_path_factory.mktemp(arch))
        out[arch] = (
            folder,
            reference.tiny_checkpoint(folder, arch, dict(model_type=model_type, **TINY, **extra)),
        )
    return out


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bert"))
    config = dict(
        model_type="bert",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        matryoshka_dimensions=[16, 32],
    )
    return folder, reference.tiny_checkpoint(folder, "BertModel", config, auto_class="AutoModel")


def assert_matches(outs, prompts, hf_model, pooling_type: str, normalize: bool) -> None:
    assert len(outs) == len(prompts)
    for ids, out in zip(prompts, outs):
        reference.assert_pooled_matches(out.outputs.embedding, hf_model, ids, pooling_type, normalize)
        assert out.prompt_token_ids == ids and out.outputs.hidden_size == hf_model.config.hidden_size


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("pooling_type", ["LAST", "CLS", "MEAN"])
def test_decoder_embeddings_match_transformers(decoders, arch, pooling_type):
    """A small KV pool and a step budget under the longest prompt: the pooling runner still
    runs each prompt whole in one step."""
    folder, hf_model = decoders[arch]
    llm = LLM(
        folder,
        dtype="float32",
        runner="pooling",
        num_blocks=24,
        block_size=8,
        max_num_batched_tokens=16,
        override_pooler_config={"pooling_type": pooling_type},
    )
    prompts = reference.random_prompts(TINY["vocab_size"], LENGTHS, seed=2)
    assert_matches(
        llm.embed(prompts), prompts, hf_model, pooling_type, normalize=True
    )  # the config's default
    assert_matches(llm.embed(prompts, PoolingParams(normalize=False)), prompts, hf_model, pooling_type, False)
    assert llm.engine.kv_cache_manager.usage == 0


def test_many_prompts_pool_in_one_step(decoders, monkeypatch):
    folder, hf_model = decoders["LlamaForCausalLM"]
    llm = LLM(folder, dtype="float32", task="embed", num_blocks=64, block_size=8)
    assert llm.engine.runner_kind == "pooling" and llm.engine.pooler_config.pooling_type == "LAST"
    steps = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: steps.append(1) or step())
    prompts = reference.random_prompts(TINY["vocab_size"], LENGTHS, seed=3)
    assert_matches(llm.embed(prompts), prompts, hf_model, "LAST", normalize=True)
    assert len(steps) == 1
    assert llm.engine.kv_cache_manager.usage == 0


def test_matryoshka_dimensions(bert):
    folder, hf_model = bert
    llm = LLM(folder, dtype="float32", num_blocks=32, block_size=8)  # runner auto: no LM head, so pooling
    assert llm.engine.runner_kind == "pooling" and llm.engine.pooler_config.pooling_type == "CLS"
    ids = reference.random_prompts(256, [11], seed=4)[0]
    [out] = llm.embed([ids], PoolingParams(dimensions=16))
    expected = torch.nn.functional.normalize(reference.hf_pooled(hf_model, ids, "CLS", False)[:16], dim=-1)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(
        ValueError, match=r"dimensions: 20 is not one of the model's matryoshka dimensions \[16, 32\]"
    ):
        llm.embed([ids], PoolingParams(dimensions=20))


def test_refusals_name_the_field(decoders, bert):
    folder, _ = decoders["LlamaForCausalLM"]
    pooling = LLM(folder, dtype="float32", runner="pooling", num_blocks=24, block_size=8)
    with pytest.raises(ValueError, match="sampling_params: this engine pools"):
        pooling.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt: must contain at least one token"):
        pooling.embed([[5, 6], []])
    with pytest.raises(
        ValueError, match="prompt: 65 tokens do not fit the context of 64 \\(max_model_len\\)$"
    ):
        pooling.embed([list(range(3, 68))])
    with pytest.raises(ValueError, match="dimensions: this model does not support matryoshka"):
        pooling.embed([[5, 6]], PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="normalize must be a boolean"):
        PoolingParams(normalize="yes")
    assert not pooling.engine.has_unfinished()
    generating = LLM(folder, dtype="float32", num_blocks=24, block_size=8)
    assert generating.engine.runner_kind == "generate"
    with pytest.raises(ValueError, match="pooling_params: this engine generates"):
        generating.embed([[5, 6, 7]])
    with pytest.raises(ValueError, match="runner: this model has no LM head"):
        LLM(bert[0], dtype="float32", runner="generate", num_blocks=24, block_size=8)
    with pytest.raises(
        ValueError, match="override_pooler_config: pooling_type must be one of LAST, CLS, MEAN"
    ):
        LLM(
            folder,
            dtype="float32",
            runner="pooling",
            num_blocks=24,
            override_pooler_config={"pooling_type": "MAX"},
        )
    with pytest.raises(ValueError, match="speculative_config: the pooling runner samples no tokens"):
        LLM(folder, dtype="float32", task="embed", num_blocks=24, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="task: 'embed' contradicts runner='generate'"):
        LLM(folder, dtype="float32", runner="generate", task="embed", num_blocks=24)


def test_a_pooling_request_that_fails_alone_is_finished_not_fatal(bert):
    """Fault isolation on a pooling engine: its probe pools too (a sampling probe would fail on
    a model without an LM head and make every lone failure fatal). A prompt with a token id
    past the vocabulary (which the request path refuses, so it is planned here directly)
    fails alone; it is finished with an error and the good request keeps its vector."""
    from engine.messages.request import Request
    from engine.messages.step import ScheduledRequest, StepPlan

    folder, hf_model = bert
    llm = LLM(folder, dtype="float32", num_blocks=32, block_size=8)
    core = llm.engine
    ids = reference.random_prompts(256, [7], seed=6)[0]
    good, bad = Request("good", ids, PoolingParams()), Request("bad", [3, 10_000, 4], PoolingParams())
    for request in (good, bad):
        core.kv_cache_manager.allocate_slots(request, request.num_tokens)
    mixed = StepPlan((ScheduledRequest(good, len(ids)), ScheduledRequest(bad, 3)))
    for plan, survivors in ((mixed, ["good"]), (StepPlan((ScheduledRequest(bad, 3),)), [])):
        with pytest.raises(IndexError) as raised:
            core._execute(plan)
        kept, result, failed = core._isolate(plan, raised.value)
        assert [o.request_id for o in failed] == ["bad"] and failed[0].finish_reason == "error"
        assert [item.request.request_id for item in kept.scheduled] == survivors
        assert list(result.pooled) == survivors
        if survivors:
            reference.assert_pooled_matches(result.pooled["good"].tolist(), hf_model, ids, "CLS", True)
