"""The hybrid's state slots under continuous batching: sixteen mixed-length prompts, chunked
prefill (16-token steps: prompts cross several steps and the scan's 8-token chunks) and a pool
small enough to preempt give each prompt the greedy tokens and prompt log-probs it gets alone,
prefilled whole. Engine against engine: the kit compares each with transformers."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing import reference
from engine_models_mamba_hybrid.bamba import BambaForCausalLM

LENGTHS = [3, 41, 17, 8, 33, 25, 5, 12, 29, 19, 1, 38, 14, 22, 9, 30]


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bamba"))
    config = BambaForCausalLM.example_configs()["BambaForCausalLM"]
    config.update(num_hidden_layers=2, attn_layer_indices=[1])  # one of each: half the steps' time
    reference.tiny_checkpoint(folder, "BambaForCausalLM", config)
    return folder


def _run(llm, prompts):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params)
    logprobs = [[next(iter(e.values())).logprob for e in o.prompt_logprobs[1:]] for o in outs]
    return [o.outputs[0].token_ids for o in outs], logprobs


def test_sixteen_mixed_prompts_with_preemption_equal_one_at_a_time(bamba):
    prompts = reference.random_prompts(256, LENGTHS, seed=5)
    alone = LLM(
        bamba, dtype="float32", num_blocks=64, block_size=8, max_model_len=64, max_num_batched_tokens=64
    )
    expected = [_run(alone, [p]) for p in prompts]
    batched = LLM(
        bamba,
        dtype="float32",
        num_blocks=14,
        block_size=8,
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )
    tokens, logprobs = _run(batched, prompts)
    assert batched.engine.stats()["preemptions"] > 0, "the pool must be small enough to preempt"
    assert tokens == [t[0] for t, _ in expected]
    for got, (_, want) in zip(logprobs, expected):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want[0]), atol=1e-4, rtol=0)


def test_state_slots_are_accounted_beside_the_pages(bamba):
    """The state group holds a slot per sequence (and the null one); prefix caching is off, and
    the start-up report says why."""
    llm = LLM(bamba, dtype="float32", num_blocks=14, block_size=8, max_model_len=64, max_num_seqs=8)
    paged, state = llm.engine.kv_groups
    assert (paged.layers, paged.num_blocks, paged.state) == ((1,), 14, False)
    assert (state.layers, state.num_blocks, state.state) == ((0,), 9, True)
    assert not llm.engine.config.cache.enable_prefix_caching
    assert any("prefix caching is off" in note for note in llm.engine.startup.notes)


def test_engine_plugins_says_why_prefix_caching_is_off(bamba, capsys):
    import argparse

    from engine.entrypoints.cli import PluginsCommand

    PluginsCommand().run(argparse.Namespace(plugins=None, model=bamba, model_impl="auto"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"model {bamba}")]
    assert lines[0].endswith("native BambaForCausalLM (plugin models-mamba-hybrid)"), lines
    assert "prefix caching is off: this model's Mamba layers keep one state per request" in lines[1], lines


def test_tensor_parallelism_is_refused_by_name(bamba):
    with pytest.raises(ValueError, match="model BambaForCausalLM is not built of tensor-parallel layers"):
        LLM(bamba, dtype="float32", num_blocks=14, tensor_parallel_size=2)
