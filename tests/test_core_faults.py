"""The engine core defends itself: it re-validates every request (offline ``LLM`` and the
core process alike), and an exception in a step fails only the request that causes it."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.messages.sampling_params import InvalidParam
from engine.plugins import add_plugin
from tests.plugins import faulty_processor
from tests.serving import serve

add_plugin(faulty_processor, "test-faulty")

VOCAB = 49152  # tests/conftest.py's TINY_LLAMA

# (SamplingParams keywords, the field the error must name)
BAD_PARAMS = [
    ({"min_tokens": 2, "stop_token_ids": [1_000_000]}, "stop_token_ids"),
    ({"min_tokens": 2, "stop_token_ids": [-49153]}, "stop_token_ids"),
    ({"min_tokens": 2, "stop_token_ids": [2**63 - 1]}, "stop_token_ids"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": ["7"]}, "stop_token_ids"),
    ({"top_k": 2**70}, "top_k"),
    ({"seed": 2**70}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 2**63 - 1, "n": 2}, "seed"),  # the second sample would be seeded 2**63
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"min_tokens": True}, "min_tokens"),
    ({"logprobs": 2**70}, "logprobs"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", 5]}, "stop"),
    ({"extra_args": [1]}, "extra_args"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_PARAMS)])
def test_offline_generate_rejects_what_the_step_cannot_handle(tiny_llm, kwargs, field):
    with pytest.raises(InvalidParam) as info:
        tiny_llm.generate("hi", SamplingParams(**kwargs))
    assert info.value.param == field
    assert field in str(info.value)
    assert not tiny_llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "prompt,priority,field",
    [
        ([5, VOCAB], 0, "prompt"),
        ([5, -1], 0, "prompt"),
        ([5, 2**70], 0, "prompt"),
        ([5, True], 0, "prompt"),
        ([5, 6], 2**63, "priority"),
        ([5, 6], -(2**70), "priority"),
    ],
)
def test_offline_generate_rejects_bad_prompts_and_priorities(tiny_llm, prompt, priority, field):
    with pytest.raises(InvalidParam) as info:
        tiny_llm.generate([prompt, [7, 8]], SamplingParams(max_tokens=2), priority=[priority, 0])
    assert info.value.param == field
    assert not tiny_llm.engine.has_unfinished()  # nothing was queued, not even the good prompt


def test_params_from_the_transport_are_checked_too():
    with pytest.raises(InvalidParam, match="unknown"):
        SamplingParams.from_dict({"temperature": 0.5, "bogus": 1})
    with pytest.raises(InvalidParam, match="structured_outputs"):
        SamplingParams.from_dict({"structured_outputs": "json"})
    params = SamplingParams(seed=2**63 - 2, n=2, stop_token_ids=[3, 4], stop="x")
    assert SamplingParams.from_dict(params.to_dict()) == params


def test_in_vocabulary_stop_ids_with_min_tokens_still_work(tiny_llm):
    out = tiny_llm.generate(
        "hi", SamplingParams(temperature=0, max_tokens=6, min_tokens=2, stop_token_ids=[0, VOCAB - 1])
    )[0].outputs[0]
    assert len(out.token_ids) >= 2


# -- step fault isolation ---------------------------------------------------------------------

PROMPTS = ["The quick brown fox", "Once upon a time", "hi", "Numbers: 1, 2, 3,"]


@pytest.fixture(scope="module")
def faulty_llm(tiny_llama):
    return LLM(
        tiny_llama[0], dtype="float32", num_blocks=128, max_model_len=256, logits_processors=["test-faulty"]
    )


OTHERS = [
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
]


@pytest.fixture(scope="module")
def baseline(faulty_llm):
    return [o.outputs[0].token_ids for o in faulty_llm.generate(PROMPTS[:3], OTHERS)]


@pytest.mark.parametrize("fault_after", [0, 4], ids=["in-prefill", "mid-decode"])
def test_a_request_that_breaks_the_step_fails_alone(faulty_llm, baseline, fault_after):
    culprit = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, extra_args={"fault_after": fault_after}
    )
    outputs = faulty_llm.generate(PROMPTS, OTHERS + [culprit])

    failed = outputs[3].outputs[0]
    assert failed.finish_reason == "error"
    assert "InjectedFault" in failed.stop_reason and "injected fault" in failed.stop_reason
    assert len(failed.token_ids) == fault_after  # what it generated before the fault
    # the others ran in the same steps; greedy and seeded outputs are exactly unchanged
    assert [o.outputs[0].token_ids for o in outputs[:3]] == baseline
    assert all(o.outputs[0].finish_reason == "length" for o in outputs[:3])
    assert not faulty_llm.engine.has_unfinished()
    assert faulty_llm.engine.stats()["kv_cache_usage"] == 0.0


def test_a_lone_faulty_request_fails_without_killing_the_engine(faulty_llm, baseline):
    [out] = faulty_llm.generate("hi", SamplingParams(max_tokens=4, extra_args={"fault_after": 1}))
    assert out.outputs[0].finish_reason == "error"
    assert len(out.outputs[0].token_ids) == 1
    again = faulty_llm.generate(PROMPTS[:3], OTHERS)  # the engine keeps serving, outputs as before
    assert [o.outputs[0].token_ids for o in again] == baseline


def test_a_fault_no_request_causes_stays_fatal(tiny_llama):
    llm = LLM(
        tiny_llama[0], dtype="float32", num_blocks=64, max_model_len=256, logits_processors=["test-broken"]
    )
    for prompts in (["hi"], PROMPTS):  # alone, and in a batch where every request fails alone
        with pytest.raises(faulty_processor.InjectedFault, match="always fails"):
            llm.generate(prompts, SamplingParams(max_tokens=3))


# -- the sweep's requests against a real server -------------------------------------------------

SWEEP = [
    ({"min_tokens": 2, "stop_token_ids": [bad]}, "stop_token_ids")
    for bad in (1_000_000, -49153, 2**63 - 1, 2**70)
] + [
    ({"stop_token_ids": [1_000_000]}, "stop_token_ids"),  # without min_tokens it used to pass silently
    ({"top_k": 2**70}, "top_k"),
    ({"seed": 2**70}, "seed"),
    ({"seed": 2**64 - 1, "n": 2}, "seed"),
]


@pytest.mark.slow
def test_the_sweeps_bad_requests_get_a_400_and_the_engine_lives_on(tiny_llama):
    canary = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    with serve(tiny_llama[0], "--dtype", "float32", "--num-blocks", "128") as server, server.http() as http:
        before = http.post("/v1/completions", json=canary).json()["choices"][0]["text"]
        for body, field in SWEEP:
            for route, payload in (
                ("/v1/completions", {"prompt": "hi"}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ):
                response = http.post(route, json={**payload, **body})
                assert response.status_code == 400, (route, body, response.text)
                assert field in response.json()["error"]["message"], response.text
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json=canary).json()["choices"][0]["text"] == before
        assert server.metric("vllm:num_requests_running") == 0
