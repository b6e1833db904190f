"""``engine serve --model-impl transformers`` on a GPT-2 checkpoint, spoken to over a real socket
with the official ``openai`` client: greedy completions are transformers' greedy tokens."""

from __future__ import annotations

import pytest

from engine.testing import reference
from engine.testing.tiny_tokenizer import tiny_tokenizer
from tests.serving import serve


@pytest.mark.slow
def test_engine_serve_gives_transformers_greedy_tokens(tmp_path):
    tokenizer = tiny_tokenizer()
    config = dict(
        model_type="gpt2", vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=128
    )
    hf_model = reference.tiny_checkpoint(str(tmp_path), "GPT2LMHeadModel", config, tokenizer=tokenizer)
    prompts = ["deep blue sea", '{"name": "abc", "tags": ["red", "green"]}']
    args = ("--model-impl", "transformers", "--dtype", "float32", "--num-blocks", "64", "--block-size", "8")
    args += ("--return-tokens-as-token-ids",)  # logprob tokens as "token_id:N": exact ids to compare
    with serve(str(tmp_path), *args) as server:
        client = server.openai()
        model = client.models.list().data[0].id
        for prompt in prompts:
            ids = tokenizer.encode(prompt)
            response = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=8,
                temperature=0,
                logprobs=1,
                extra_body={"ignore_eos": True},
            )
            tokens = [int(t.removeprefix("token_id:")) for t in response.choices[0].logprobs.tokens]
            assert tokens == reference.hf_greedy(hf_model, [ids], 8)[0], prompt
