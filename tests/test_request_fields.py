"""vLLM's request fields on a real `engine serve`, through the official `openai` client
(``extra_body`` for vLLM's extras): each changes the output observably, and bad values are a
400 naming the field that leaves the engine serving."""

from __future__ import annotations

import openai
import pytest

from engine import LLM, SamplingParams
from engine.messages.sampling_params import tokenize_bad_words
from tests.serving import serve

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
# the usual ChatML turns, plus a variable the request sets through chat_template_kwargs
TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if persona is defined %}Speaking as {{ persona }}: {% endif %}{% endif %}"
)
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
GREEDY = {"temperature": 0, "max_tokens": 16}
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(tiny_llama, template_file):
    with serve(
        tiny_llama[0],
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--num-blocks",
        "128",
        "--block-size",
        "16",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--chat-template",
        template_file,
        "--enable-prompt-tokens-details",
        "--return-tokens-as-token-ids",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_llama, template_file):
    llm = LLM(tiny_llama[0], dtype="float32", num_blocks=128, block_size=16, max_model_len=MAX_MODEL_LEN)
    with open(template_file) as f:
        llm.tokenizer.chat_template = f.read()
    return llm


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def _ids(tokens: list[str]) -> list[int]:
    """Token ids from ``return_tokens_as_token_ids`` logprob tokens (``token_id:N``)."""
    assert all(t.startswith("token_id:") for t in tokens)
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _completion_ids(client, **fields) -> list[int]:
    extra = {"return_tokens_as_token_ids": True, **IGNORE_EOS, **fields.pop("extra_body", {})}
    out = client.completions.create(
        model="tiny",
        prompt=fields.pop("prompt", PROMPT),
        logprobs=0,
        extra_body=extra,
        **{**GREEDY, **fields},
    )
    return _ids(out.choices[0].logprobs.tokens)


def test_return_tokens_as_token_ids_on_both_routes(client, offline):
    expected = offline.generate(PROMPT, SamplingParams(**GREEDY, **IGNORE_EOS))[0].outputs[0].token_ids
    assert _completion_ids(client) == expected
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        logprobs=2,
        echo=True,
        extra_body={"return_tokens_as_token_ids": True},
        max_tokens=2,
        temperature=0,
    )
    echoed = out.choices[0].logprobs
    assert _ids(echoed.tokens[:3]) == offline.tokenizer.encode(PROMPT)[:3]
    assert all(key.startswith("token_id:") for top in echoed.top_logprobs[1:] for key in top)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, **IGNORE_EOS},
    )
    content = chat.choices[0].logprobs.content
    assert len(_ids([c.token for c in content])) == 4
    assert bytes(content[0].bytes).decode() == content[0].token
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
    # the server's --return-tokens-as-token-ids is the default a request may turn off
    by_flag = client.completions.create(model="tiny", prompt=PROMPT, logprobs=0, max_tokens=2, temperature=0)
    assert _ids(by_flag.choices[0].logprobs.tokens) == expected[:2]
    plain = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        logprobs=0,
        max_tokens=2,
        temperature=0,
        extra_body={"return_tokens_as_token_ids": False},
    )
    assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)


def test_logit_bias_makes_greedy_emit_the_token(client, offline):
    plain = _completion_ids(client)
    target = next(t for t in range(200, 2000) if t not in plain)
    assert _completion_ids(client, logit_bias={str(target): 100}) == [target] * GREEDY["max_tokens"]
    assert _completion_ids(client, logit_bias={str(plain[0]): -100})[0] != plain[0]


def test_allowed_token_ids_restrict_every_sampled_token(client):
    allowed = [11, 57, 300, 1234, 4000]
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        n=3,
        max_tokens=24,
        temperature=1.0,
        seed=5,
        logprobs=True,
        extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True, **IGNORE_EOS},
    )
    for choice in chat.choices:
        assert set(_ids([c.token for c in choice.logprobs.content])) <= set(allowed)
    assert not set(_completion_ids(client, temperature=1.0, seed=5, max_tokens=24)) <= set(allowed)


def test_bad_words_never_appear_where_greedy_produced_them(client, offline):
    plain = _completion_ids(client)
    for start in range(2, len(plain) - 1):
        word = offline.tokenizer.decode(plain[start : start + 2])
        sequences = tokenize_bad_words(
            SamplingParams(bad_words=[word]), offline.tokenizer
        ).bad_words_token_ids
        if tuple(plain[start : start + 2]) in sequences:
            break
    else:
        raise AssertionError("no two-token span of the greedy output round-trips through the tokenizer")
    banned = _completion_ids(client, extra_body={"bad_words": [word]})
    assert banned != plain
    assert not any(tuple(banned[i : i + len(s)]) == s for s in sequences for i in range(len(banned)))


def test_truncate_prompt_tokens_changes_prompt_tokens(client, offline):
    full = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    cut = client.completions.create(
        model="tiny", prompt=PROMPT, **GREEDY, extra_body={"truncate_prompt_tokens": 4}
    )
    ids = offline.tokenizer.encode(PROMPT)
    assert full.usage.prompt_tokens == len(ids) and cut.usage.prompt_tokens == 4
    expected = offline.generate({"prompt_token_ids": ids[-4:]}, SamplingParams(**GREEDY))[0].outputs[0].text
    assert cut.choices[0].text == expected
    echoed = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, echo=True, extra_body={"truncate_prompt_tokens": 4}
    )
    assert echoed.choices[0].text.startswith(offline.tokenizer.decode(ids[-4:]))
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 6},
    )
    assert chat.usage.prompt_tokens == 6


def test_chat_template_kwargs_reach_the_template(client, offline):
    messages = [{"role": "user", "content": "Tell me a story."}]
    plain = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    styled = client.chat.completions.create(
        model="tiny",
        messages=messages,
        **GREEDY,
        extra_body={"chat_template_kwargs": {"persona": "a pirate"}},
    )
    ids = offline.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, persona="a pirate"
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert styled.usage.prompt_tokens == len(ids) > plain.usage.prompt_tokens
    expected = offline.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY))[0].outputs[0].text
    assert styled.choices[0].message.content == expected


def test_continue_final_message_continues_the_assistant_message(client, offline):
    messages = [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "Once upon a"},
    ]
    out = client.chat.completions.create(
        model="tiny",
        messages=messages,
        **GREEDY,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    ids = offline.tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert offline.tokenizer.decode(ids).endswith("Once upon a")  # open: no end-of-turn after it
    assert out.usage.prompt_tokens == len(ids)
    expected = offline.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY))[0].outputs[0].text
    assert out.choices[0].message.content == expected
    closed = client.chat.completions.create(
        model="tiny", messages=messages, **GREEDY, extra_body={"add_generation_prompt": False}
    )
    assert (
        closed.usage.prompt_tokens > out.usage.prompt_tokens
    )  # <|im_end|> and the newline follow the message


def test_tokenize_templates_messages_as_chat_does(server, offline):
    messages = [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "Once upon a"},
    ]
    with server.http() as http:
        opened = http.post(
            "/tokenize",
            json={"messages": messages, "add_generation_prompt": False, "continue_final_message": True},
        ).json()
        styled = http.post(
            "/tokenize", json={"messages": messages[:1], "chat_template_kwargs": {"persona": "a pirate"}}
        ).json()
    ids = offline.tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    assert opened["tokens"] == list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert offline.tokenizer.decode(styled["tokens"]).endswith("Speaking as a pirate: ")


def test_cached_tokens_count_prefix_cache_hits(client):
    prompt = PROMPT * 4  # several full blocks
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage[0].prompt_tokens_details is not None


BAD = [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"logit_bias": {"1000000": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"allowed_token_ids": [1000000]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": ["   "]}, "bad_words"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
    ({"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
]
BAD_CHAT = [
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "persona"}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt defaults to true
    ({"continue_final_message": "yes", "add_generation_prompt": False}, "continue_final_message"),
    ({"store": True}, "store"),  # stored chat completions are not kept
]


def test_store_false_is_served(client):
    """OpenAI's ``store`` as its SDK users send it (BFCL's handler sets it on every request)."""
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, store=False)
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize(("extra", "param"), BAD + BAD_CHAT)
def test_bad_values_are_400s_naming_the_field(client, extra, param):
    messages = [{"role": "user", "content": "hi"}]
    routes = [
        lambda: client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, extra_body=extra
        )
    ]
    if (extra, param) in BAD:
        routes.append(
            lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=extra)
        )
    for call in routes:
        with pytest.raises(openai.BadRequestError) as error:
            call()
        assert error.value.body["param"] == param, error.value.body
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None
