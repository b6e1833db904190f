"""The token masks of ``SamplingParams`` through ``LLM``: ``logit_bias``, ``allowed_token_ids``,
``bad_words`` (also mid-sequence), ``min_tokens``, and ``truncate_prompt_tokens``; each changes
the output observably, logprobs stay the raw distribution (vLLM's default ``logprobs_mode``),
the masks hold under ngram speculation, and bad values are InvalidParam naming the field."""

from __future__ import annotations

import bisect
import math

import pytest

from engine import LLM, GrammarSpec, SamplingParams
from engine.messages.sampling_params import InvalidParam, tokenize_bad_words
from engine.runner.sampler import banned_bad_words

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def grammar_llm(tiny_llama):
    return LLM(
        tiny_llama[0],
        dtype="float32",
        num_blocks=64,
        max_model_len=256,
        structured_outputs_backend="xgrammar",
    )


def _tokens(llm, params, prompt=PROMPT):
    return llm.generate(prompt, params)[0].outputs[0].token_ids


def _contains(tokens, sequence) -> bool:
    n = len(sequence)
    return any(tuple(tokens[i : i + n]) == tuple(sequence) for i in range(len(tokens) - n + 1))


def test_logit_bias_makes_greedy_emit_the_token_and_logprobs_stay_raw(tiny_llm):
    plain = tiny_llm.generate(PROMPT, SamplingParams(**GREEDY))[0].outputs[0]
    # raw logprobs: the first position's distribution is the model's own, bias or not
    first = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logprobs=-1))[0].outputs[0]
    values = sorted(entry.logprob for entry in first.logprobs[0].values())
    target = next(
        t
        for t in range(100, 1000)
        if t not in plain.token_ids and _alone(first.logprobs[0][t].logprob, values)
    )
    biased = tiny_llm.generate(PROMPT, SamplingParams(**GREEDY, logprobs=0, logit_bias={target: 100}))[
        0
    ].outputs[0]
    assert biased.token_ids == [target] * GREEDY["max_tokens"]
    assert biased.logprobs[0][target].logprob == pytest.approx(first.logprobs[0][target].logprob, abs=1e-5)
    assert biased.logprobs[0][target].rank == first.logprobs[0][target].rank > 1
    pushed_down = _tokens(tiny_llm, SamplingParams(**GREEDY, logit_bias={plain.token_ids[0]: -100}))
    assert pushed_down[0] != plain.token_ids[0]


def _alone(logprob: float, values: list[float]) -> bool:
    """No other token's logprob within float noise of this one: its rank is then the same in any
    batch (a tie's order may flip with the summation order of another kernel path)."""
    i = bisect.bisect_left(values, logprob - 1e-4)
    return bisect.bisect_right(values, logprob + 1e-4) - i == 1


def test_allowed_token_ids_restrict_every_sampled_token(tiny_llm):
    allowed = [11, 57, 300, 1234, 4000]
    outs = tiny_llm.generate(
        [PROMPT, "Hello"],
        SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed),
    )
    for out in outs:
        assert set(out.outputs[0].token_ids) <= set(allowed)
        assert len(set(out.outputs[0].token_ids)) > 1  # sampled among them, not stuck on one
    assert not set(_tokens(tiny_llm, SamplingParams(temperature=1.0, seed=7, max_tokens=16))) <= set(allowed)


def _bad_word_from(llm, tokens) -> tuple[str, tuple[int, ...]]:
    """A two-token word greedy produced mid-output that tokenizes back to that pair."""
    for start in range(2, len(tokens) - 1):
        word = llm.tokenizer.decode(tokens[start : start + 2])
        sequences = tokenize_bad_words(SamplingParams(bad_words=[word]), llm.tokenizer).bad_words_token_ids
        if tuple(tokens[start : start + 2]) in sequences:
            return word, sequences
    raise AssertionError("no two-token span of the greedy output round-trips through the tokenizer")


def test_bad_words_never_appear_even_mid_sequence(tiny_llm):
    plain = _tokens(tiny_llm, SamplingParams(**GREEDY))
    word, sequences = _bad_word_from(tiny_llm, plain)
    assert any(_contains(plain, s) for s in sequences)
    banned = _tokens(tiny_llm, SamplingParams(**GREEDY, bad_words=[word]))
    assert not any(_contains(banned, s) for s in sequences)
    assert banned != plain
    single = _tokens(tiny_llm, SamplingParams(**GREEDY, bad_words=[tiny_llm.tokenizer.decode([plain[0]])]))
    assert plain[0] not in single


def test_bad_word_prefix_matching():
    params = SamplingParams(bad_words=["x"], bad_words_token_ids=[[5], [7, 8], [1, 2, 3]])
    assert banned_bad_words(params, [9, 1], [2]) == [5, 3]  # a draft counts as output already
    assert banned_bad_words(params, [7], ()) == [5, 8]
    assert banned_bad_words(params, [], ()) == [5]


def test_min_tokens_bans_eos_until_reached(tiny_llm):
    eos = tiny_llm.engine.eos_token_id
    biased = {"temperature": 0, "max_tokens": 12, "logit_bias": {eos: 100}}
    assert _tokens(tiny_llm, SamplingParams(**biased)) == [eos]
    assert len(_tokens(tiny_llm, SamplingParams(**biased, min_tokens=5))) == 6


def test_masks_hold_under_ngram_speculation(tiny_llama):
    llm = LLM(
        tiny_llama[0],
        dtype="float32",
        num_blocks=128,
        max_model_len=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    )
    prompt = "one two three one two three one two three one two three"
    plain = _tokens(llm, SamplingParams(**GREEDY), prompt)
    word, sequences = _bad_word_from(llm, plain)
    params = SamplingParams(**GREEDY, bad_words=[word])
    assert not any(_contains(_tokens(llm, params, prompt), s) for s in sequences)
    allowed = sorted(set(plain))[:3]
    sampled = llm.generate(
        [prompt] * 3,
        SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed),
    )
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in sampled)
    assert llm.engine.stats()["spec_draft_tokens"] > 0


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_llm):
    ids = tiny_llm.tokenizer.encode(PROMPT)
    out = tiny_llm.generate(PROMPT, SamplingParams(**GREEDY, truncate_prompt_tokens=5))[0]
    assert out.prompt_token_ids == ids[-5:]
    assert out.outputs[0].token_ids == _tokens(
        tiny_llm, SamplingParams(**GREEDY), {"prompt_token_ids": ids[-5:]}
    )
    whole = tiny_llm.generate(PROMPT, SamplingParams(**GREEDY, truncate_prompt_tokens=-1))[0]
    assert whole.prompt_token_ids == ids
    with pytest.raises(InvalidParam) as error:
        tiny_llm.generate(PROMPT, SamplingParams(truncate_prompt_tokens=tiny_llm.engine.max_model_len + 1))
    assert error.value.param == "truncate_prompt_tokens"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {5: math.nan}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"allowed_token_ids": "5"}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": [5]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 2**70}, "truncate_prompt_tokens"),
    ],
)
def test_bad_values_name_the_field(fields, param):
    with pytest.raises(InvalidParam) as error:
        SamplingParams(**fields)
    assert error.value.param == param


@pytest.mark.parametrize(
    "fields", [{"logit_bias": {10**7: 1.0}}, {"allowed_token_ids": [10**7]}, {"stop_token_ids": [10**7]}]
)
def test_token_ids_outside_the_vocabulary_are_refused(tiny_llm, fields):
    with pytest.raises(InvalidParam) as error:
        tiny_llm.generate(PROMPT, SamplingParams(**fields))
    assert error.value.param == next(iter(fields))
    assert _tokens(tiny_llm, SamplingParams(**GREEDY))  # the engine still serves


def test_masks_survive_the_transport():
    params = SamplingParams(
        logit_bias={3: 1.5},
        allowed_token_ids=[1, 2, 3],
        bad_words=["a"],
        bad_words_token_ids=[[1, 2]],
        truncate_prompt_tokens=4,
    )
    import msgspec

    data = msgspec.msgpack.decode(msgspec.msgpack.encode(params.to_dict()))
    assert SamplingParams.from_dict(data) == params


def test_masks_compose_with_a_grammar(grammar_llm):
    llm = grammar_llm
    choices = ["apple pie", "pear tart"]
    grammar = GrammarSpec("choice", choices)
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, structured_outputs=grammar))[
        0
    ].outputs[0]
    other = choices[1 - choices.index(plain.text)]
    # the bias pushes greedy off the grammar's own first choice: it takes the other one
    away = {plain.token_ids[0]: -100}
    assert (
        llm.generate(
            PROMPT, SamplingParams(temperature=0, max_tokens=8, structured_outputs=grammar, logit_bias=away)
        )[0]
        .outputs[0]
        .text
        == other
    )
    # a bias toward a token the grammar forbids does not break the grammar
    outside = next(t for t in range(300, 3000) if t not in plain.token_ids)
    forced = llm.generate(
        PROMPT,
        SamplingParams(
            temperature=0, max_tokens=8, structured_outputs=grammar, logit_bias={outside: 100}, logprobs=0
        ),
    )[0].outputs[0]
    assert forced.text in choices and outside not in forced.token_ids
    # bad words ban their canonical tokenization, which the grammar's first token here is
    word = llm.tokenizer.decode(plain.token_ids[:1])
    assert (plain.token_ids[0],) in tokenize_bad_words(
        SamplingParams(bad_words=[word]), llm.tokenizer
    ).bad_words_token_ids
    banned = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=8, structured_outputs=grammar, bad_words=[word])
    )[0].outputs[0]
    assert banned.text == other


def test_masks_that_leave_no_token_fail_only_their_request(grammar_llm):
    llm = grammar_llm
    grammar = GrammarSpec("choice", ["apple", "pear"])
    first_tokens = {llm.tokenizer.encode(word)[0] for word in ("apple", "pear")}
    outside = next(t for t in range(300, 3000) if t not in first_tokens)
    alone = SamplingParams(**GREEDY)
    expected = llm.generate("Hello", alone)[0].outputs[0].token_ids
    contradicting = SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=grammar, allowed_token_ids=[outside]
    )
    failed, other = llm.generate([PROMPT, "Hello"], [contradicting, alone])
    assert failed.outputs[0].finish_reason == "error" and "no token is left" in str(
        failed.outputs[0].stop_reason
    )
    assert other.outputs[0].token_ids == expected
