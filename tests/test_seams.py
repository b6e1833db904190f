"""Each step-loop seam exercised through a small test plugin (tests/plugins/): the grammar
bitmask, draft verification, external KV tokens, logits processors and linear methods."""

from __future__ import annotations

import time

import pytest
import torch

from engine import LLM, GrammarSpec, SamplingParams
from engine.messages.request import Request, RequestStatus
from engine.testing import reference

CHOICES = ["yes", "no", "maybe later"]


@pytest.fixture(scope="module")
def choice_llm(tiny_llama):
    return LLM(
        tiny_llama[0],
        dtype="float32",
        num_blocks=256,
        block_size=16,
        structured_outputs_backend="test-choice",
    )


def test_grammar_bitmask_constrains_sampling(choice_llm):
    params = [
        SamplingParams(
            temperature=1.0, seed=s, max_tokens=10, structured_outputs=GrammarSpec("choice", CHOICES)
        )
        for s in range(12)
    ]
    outs = choice_llm.generate(["Answer:"] * 12, params)
    texts = {o.outputs[0].text for o in outs}
    assert texts <= set(CHOICES) and len(texts) > 1
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_invalid_grammar_fails_that_request_alone(choice_llm):
    bad = SamplingParams(max_tokens=5, structured_outputs=GrammarSpec("regex", "[a-z]+"))
    good = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = choice_llm.generate(["first", "second"], [bad, good])
    assert outs[0].outputs[0].finish_reason == "error"
    assert "test-choice compiles only choice lists" in outs[0].outputs[0].stop_reason
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 5


def test_slow_grammar_compilation_does_not_block_others(choice_llm):
    engine = choice_llm.engine
    ids = choice_llm.tokenizer.encode("Pick one:")
    slow = Request(
        "slow", ids, SamplingParams(max_tokens=8, structured_outputs=GrammarSpec("choice", ["slow:2:yes"]))
    )
    fast = Request("fast", ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.add_request(slow)
    engine.add_request(fast)
    started = time.monotonic()
    while not fast.is_finished:
        engine.step()
    assert time.monotonic() - started < 1.5
    assert slow.status is RequestStatus.WAITING_FOR_GRAMMAR and not slow.output_token_ids
    while engine.has_unfinished():
        engine.step()
    text = choice_llm.tokenizer.decode(slow.output_token_ids, skip_special_tokens=True)
    assert text == "yes" and slow.finish_reason == "stop"


def _greedy(llm, prompts, n):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_draft_verification_is_exact_under_preemption(tiny_llama):
    folder, hf_model = tiny_llama
    prompts = reference.random_prompts(hf_model.config.vocab_size, [5, 30, 12, 44, 8, 21], seed=4)
    options = dict(
        dtype="float32",
        block_size=8,
        num_blocks=24,
        max_num_batched_tokens=32,
        max_num_seqs=6,
        max_model_len=160,
    )
    baseline = _greedy(LLM(folder, **options), prompts, 20)
    continuations = [p + out for p, out in zip(prompts, baseline)]
    spec = LLM(
        folder,
        speculative_config={
            "method": "test-oracle",
            "num_speculative_tokens": 3,
            "continuations": continuations,
        },
        **options,
    )
    assert _greedy(spec, prompts, 20) == baseline
    stats = spec.engine.stats()
    assert stats["preemptions"] > 0
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    sampled = spec.generate(prompts, SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 12 for o in sampled)


CONNECTOR_OPTIONS = dict(
    dtype="float32", block_size=8, num_blocks=64, max_model_len=256, enable_prefix_caching=False
)


@pytest.fixture(scope="module")
def shared_prefix(tiny_llama):
    folder, hf_model = tiny_llama
    shared = reference.random_prompts(hf_model.config.vocab_size, [40], seed=5)[0]
    second = shared + [21, 22]
    return shared + [11, 12, 13], second, _greedy(LLM(folder, **CONNECTOR_OPTIONS), [second], 10)[0]


def _memory_llm(folder, **extra):
    config = {"kv_connector": "test-memory", "kv_connector_extra_config": extra}
    return LLM(folder, kv_transfer_config=config, **CONNECTOR_OPTIONS)


def _worker(llm):
    return llm.engine.runner.connector


def test_connector_supplies_external_tokens(tiny_llama, shared_prefix):
    first, second, expected = shared_prefix
    llm = _memory_llm(tiny_llama[0])
    _greedy(llm, [first], 4)
    out = llm.generate([second], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert len(_worker(llm).store) == 5  # the first request's 40-token prefix: 5 full blocks
    assert out.outputs[0].token_ids == expected
    assert out.num_cached_tokens == 40  # the external hit counts as cached (usage.prompt_tokens_details)
    stats = llm.engine.stats()
    assert stats["external_prefix_hits"] == 40 and stats["kv_load_failures"] == 0
    assert stats["kv_load_bytes"] == 0  # the test connector reports no bytes; the offload plugin does


def test_connector_hooks_run_per_layer_inside_the_forward(tiny_llama, shared_prefix):
    llm = _memory_llm(tiny_llama[0])
    _greedy(llm, [shared_prefix[0]], 1)
    num_layers = len(llm.engine.runner.kv_caches)
    events = _worker(llm).events
    step = [("start", -1)] + [(kind, layer) for layer in range(num_layers) for kind in ("load", "save")]
    assert events[: len(step)] == step


def test_asynchronous_load_parks_the_request(tiny_llama, shared_prefix):
    first, second, expected = shared_prefix
    llm = _memory_llm(tiny_llama[0], **{"async": True})
    _greedy(llm, [first], 4)
    assert _greedy(llm, [second], 10) == [expected]
    assert llm.engine.stats()["external_prefix_hits"] == 40


@pytest.mark.parametrize("mode", [{}, {"async": True}], ids=["sync", "async"])
def test_failed_load_recomputes_from_the_last_good_block(tiny_llama, shared_prefix, mode):
    first, second, expected = shared_prefix
    llm = _memory_llm(tiny_llama[0], fail_every=3, **mode)
    _greedy(llm, [first], 4)
    out = llm.generate([second], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == expected
    stats = llm.engine.stats()
    assert stats["kv_load_failures"] == 1 and stats["external_prefix_hits"] == 16  # blocks 0-1 of 5 loaded
    assert out.num_cached_tokens == 16


def test_kv_transfer_config_errors_name_the_field(tiny_llama):
    with pytest.raises(ValueError, match="kv_transfer_config.kv_role"):
        LLM(
            tiny_llama[0],
            kv_transfer_config={"kv_connector": "test-memory", "kv_role": "sideways"},
            **CONNECTOR_OPTIONS,
        )
    with pytest.raises(ValueError, match="unknown key"):
        LLM(
            tiny_llama[0],
            kv_transfer_config={"kv_connector": "test-memory", "kv_size": 1},
            **CONNECTOR_OPTIONS,
        )


def test_logits_processor_plugin(tiny_llama, tiny_llm):
    prompt = [5, 6, 7, 8]
    plain = _greedy(tiny_llm, [prompt], 6)[0]
    llm = LLM(
        tiny_llama[0], dtype="float32", num_blocks=64, max_model_len=256, logits_processors=["test-ban"]
    )
    banned = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args={"ban": [plain[0]]})
    outs = llm.generate(
        [prompt, prompt], [banned, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]
    )
    assert plain[0] not in outs[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == plain


def test_quant_method_plugin_replaces_linear_storage(tiny_llama, tiny_llm):
    llm = LLM(tiny_llama[0], dtype="float32", num_blocks=64, max_model_len=256, quantization="test-int8")
    qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.int8 and not hasattr(qkv, "weight")
    prompt = reference.random_prompts(49152, [24], seed=6)[0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=5, temperature=0)
    exact = tiny_llm.generate([prompt], params)[0].prompt_logprobs
    quant = llm.generate([prompt], params)[0].prompt_logprobs
    for a, b in zip(exact[1:], quant[1:]):
        token = next(iter(a))
        assert abs(a[token].logprob - b[token].logprob) < 0.02 + 0.02 * abs(a[token].logprob)
