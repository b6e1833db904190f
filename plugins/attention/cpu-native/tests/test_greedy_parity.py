"""A tiny Llama through ``LLM(..., attention_backend="cpu-native")`` gives transformers' greedy
tokens: whole prompts (the short ones in C, the long ones by the torch backend) and prompts in
chunks of 8 tokens (every chunk in C, later chunks beside decode rows), decoded in C."""

import pytest

from engine import LLM, SamplingParams
from engine.testing import reference

LENGTHS = [5, 40, 16, 3, 70, 11, 29]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny"))
    model = reference.tiny_checkpoint(
        folder,
        "LlamaForCausalLM",
        dict(
            model_type="llama",
            vocab_size=256,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        ),
    )
    return folder, model


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prompts", "chunks-of-8"])
def test_greedy_tokens_match_transformers(tiny_model, chunk):
    folder, hf_model = tiny_model
    prompts = reference.random_prompts(256, LENGTHS, seed=5)
    options = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(
        folder, dtype="float32", attention_backend="cpu-native", block_size=16, max_model_len=256, **options
    )
    assert llm.engine.runner.attention.name == "cpu-native"
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == reference.hf_greedy(hf_model, prompts, 20)
