"""The offline API: clear errors before any work, and the sampling features users expect."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.testing import reference


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-1), "temperature"),
        (dict(n=0), "n"),
        (dict(min_p=2), "min_p"),
        (dict(logprobs=-2), "logprobs"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_model_path_is_a_clear_error():
    with pytest.raises(ValueError, match="model: cannot load '/no/such/model'"):
        LLM("/no/such/model")


def test_unknown_engine_option_is_a_clear_error():
    with pytest.raises(TypeError, match="unknown engine option 'max_num_seq'"):
        LLM(max_num_seq=4)


def test_bad_prompts_fail_before_any_work(tiny_llm):
    too_long = list(range(3, 3 + 600))
    with pytest.raises(ValueError, match="prompt: 600 tokens do not fit"):
        tiny_llm.generate(["fine", too_long], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt: token ids must be in"):
        tiny_llm.generate([[1, 2, 10**7]])
    with pytest.raises(ValueError, match="prompt: must contain at least one token"):
        tiny_llm.generate([[]])
    assert not tiny_llm.engine.has_unfinished()


def test_text_round_trips_through_the_tokenizer(tiny_llm):
    out = tiny_llm.generate(
        "The weather today is", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )[0]
    assert out.prompt == "The weather today is"
    assert out.outputs[0].text == tiny_llm.tokenizer.decode(
        out.outputs[0].token_ids, skip_special_tokens=True
    )
    assert out.outputs[0].finish_reason == "length" and out.finished
    assert tiny_llm.get_tokenizer() is tiny_llm.tokenizer  # vLLM's spelling, which its users' scripts call


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    alone = tiny_llm.generate("Once upon a time", params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)] * 3
    batch = tiny_llm.generate(
        ["Hello", "Once upon a time", "A list:", "Why"], [others[0], params, *others[1:]]
    )
    assert batch[1].outputs[0].token_ids == alone
    again = tiny_llm.generate("Once upon a time", params)[0].outputs[0].token_ids
    assert again == alone


def test_n_samples_share_the_prompt_blocks(tiny_llm):
    prompt = reference.random_prompts(49152, [70], seed=9)[0]
    hits_before = tiny_llm.engine.kv_cache_manager.stats["prefix_hits"]
    out = tiny_llm.generate(
        [prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    hits = tiny_llm.engine.kv_cache_manager.stats["prefix_hits"] - hits_before
    assert hits >= 3 * (70 // 16) * 16, "children after the first must reuse the prompt's full blocks"


def test_logprobs_and_prompt_logprobs(tiny_llm):
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = tiny_llm.generate("Counting: one two", params)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    total = 0.0
    for token, position in zip(completion.token_ids, completion.logprobs):
        assert token in position and position[token].rank == 1  # greedy picks the top token
        assert 3 <= len(position) <= 4
        assert position[token].decoded_token == tiny_llm.tokenizer.decode([token])
        total += position[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token in position and all(lp.logprob <= 0 for lp in position.values())


def test_prompt_logprobs_cover_a_cached_prefix(tiny_llm):
    """A prefix-cache hit must not cut prompt log-probs short: those positions are recomputed."""
    shared = reference.random_prompts(49152, [48], seed=11)[0]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    first = tiny_llm.generate([shared + [7, 8, 9]], params)[0]
    again = tiny_llm.generate([shared + [10, 11]], params)[0]
    assert len(again.prompt_logprobs) == len(shared) + 2
    for position in range(1, len(shared)):
        assert again.prompt_logprobs[position] == first.prompt_logprobs[position]


def test_stop_strings_and_stop_tokens(tiny_llm):
    base = tiny_llm.generate("Story:", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[
        0
    ].outputs[0]
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    cut = tiny_llm.generate(
        "Story:", SamplingParams(max_tokens=30, temperature=0, stop=[stop], ignore_eos=True)
    )[0]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.outputs[0].text == base.text[: base.text.index(stop)]
    kept = tiny_llm.generate(
        "Story:",
        SamplingParams(
            max_tokens=30, temperature=0, stop=stop, include_stop_str_in_output=True, ignore_eos=True
        ),
    )[0]
    assert kept.outputs[0].text == base.text[: base.text.index(stop) + len(stop)]
    stop_id = base.token_ids[2]
    by_id = tiny_llm.generate(
        "Story:", SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_id])
    )[0]
    first = base.token_ids.index(stop_id)
    assert (
        by_id.outputs[0].token_ids == base.token_ids[: first + 1] and by_id.outputs[0].stop_reason == stop_id
    )
    held = tiny_llm.generate(
        "Story:", SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_id], min_tokens=first + 2)
    )[0].outputs[0]
    assert len(held.token_ids) >= first + 2 and stop_id not in held.token_ids[: first + 2]


def test_chat_uses_the_checkpoint_template(tiny_llm):
    messages = [{"role": "user", "content": "Hi there"}]
    out = tiny_llm.chat(messages, SamplingParams(max_tokens=3, temperature=0))[0]
    expected = tiny_llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert out.prompt_token_ids == expected
    with pytest.raises(ValueError, match="role"):
        tiny_llm.chat([{"role": "wizard", "content": "x"}])


def test_chat_template_kwargs_and_continue_final_message(tiny_llm):
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ extra | default('') }}"
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon a"}]
    params = SamplingParams(max_tokens=2, temperature=0)
    decode = tiny_llm.tokenizer.decode

    def prompt(**options):
        return decode(tiny_llm.chat(messages, params, chat_template=template, **options)[0].prompt_token_ids)

    assert prompt().endswith("<|im_start|>assistant\n")
    assert prompt(chat_template_kwargs={"extra": "[x]"}).endswith("assistant\n[x]")
    assert prompt(add_generation_prompt=False, continue_final_message=True).endswith("Once upon a")
    with pytest.raises(ValueError, match="continue_final_message"):
        tiny_llm.chat(messages, params, chat_template=template, continue_final_message=True)
    with pytest.raises(ValueError, match="tokenize"):
        tiny_llm.chat(messages, params, chat_template=template, chat_template_kwargs={"tokenize": False})


def test_priority_policy_runs_the_urgent_request_first(tiny_llama):
    from engine.messages.request import Request

    llm = LLM(
        tiny_llama[0], dtype="float32", num_blocks=64, max_model_len=256, policy="priority", max_num_seqs=1
    )
    later = Request("later", [5, 6, 7], SamplingParams(max_tokens=2), priority=5)
    urgent = Request("urgent", [5, 6, 7], SamplingParams(max_tokens=2), priority=0)
    llm.engine.add_request(later)
    llm.engine.add_request(urgent)
    first = llm.engine.step()
    assert [o.request_id for o in first] == ["urgent"] and not later.output_token_ids
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=2, temperature=0), priority=[5, 0])
    assert all(o.finished for o in outs)


def test_max_tokens_none_runs_to_the_context(tiny_llama):
    llm = LLM(tiny_llama[0], dtype="float32", num_blocks=8, block_size=16, max_model_len=64)
    out = llm.generate([[5] * 10], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 54 and out.outputs[0].finish_reason == "length"
