"""LoRA adapters compose with speculation and structured outputs: the verifier runs each row
with its request's adapter, so drafts — from n-grams, from a suffix tree, or from a draft model
that knows nothing of the adapter — change no greedy token of a mixed batch of base and adapted
requests; a grammar constrains adapted requests as it does base ones."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, GrammarSpec, LoRARequest, SamplingParams
from tests.test_lora import ADAPTERS, save_adapter

peft = pytest.importorskip("peft")

DRAFTERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    # with a corpus, a second pass over the same prompts drafts from the first's answers
    "suffix": {"method": "suffix", "num_speculative_tokens": 4, "corpus": True},
    # the base checkpoint drafts for every adapter: it knows none of them
    "draft-model": {"method": "draft_model", "num_speculative_tokens": 3, "model": "{base}"},
}
PROMPTS = [
    "the cat sat on the mat and the cat sat on the",
    "one two three one two three one two",
    "a b c d a b c d a b",
    "red green blue red green blue red",
]
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["items"],
    "properties": {"items": {"type": "array", "minItems": 2, "maxItems": 4, "items": {"enum": ["x", "y"]}}},
}


@pytest.fixture(scope="module")
def adapted(tiny_llama, tmp_path_factory):
    """(base folder, a LoRARequest per prompt: base rows and two adapters interleaved)."""
    base = tiny_llama[0]
    requests = []
    for lora_id in (1, 2):
        fields, seed = ADAPTERS[lora_id]
        folder = str(tmp_path_factory.mktemp(f"adapter-{lora_id}"))
        save_adapter(base, folder, seed, **fields)
        requests.append(LoRARequest(f"adapter-{lora_id}", lora_id, folder))
    return base, [None, requests[0], requests[1], requests[0]]


def _llm(base: str, **options) -> LLM:
    return LLM(base, dtype="float32", enable_lora=True, max_lora_rank=32, num_blocks=128, **options)


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_drafts_change_no_token_of_adapted_requests(adapted, drafter):
    base, requests = adapted
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in _llm(base).generate(PROMPTS, greedy, lora_request=requests)]
    config = {k: v.format(base=base) if isinstance(v, str) else v for k, v in DRAFTERS[drafter].items()}
    spec = _llm(base, speculative_config=config)
    for _ in range(2):
        drafted = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy, lora_request=requests)]
        assert drafted == plain
    stats = spec.engine.stats()
    assert stats["spec_draft_tokens"] > 0
    if drafter != "ngram":  # a random model's answers repeat no n-gram of its prompt
        assert stats["spec_accepted_tokens"] > 0


def test_a_grammar_constrains_adapted_requests_with_and_without_drafts(adapted):
    pytest.importorskip("engine_grammar_xgrammar", reason="the xgrammar plugin is not installed")
    base, requests = adapted
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=GrammarSpec("json", SCHEMA))
    options = dict(max_model_len=256, structured_outputs_backend="xgrammar")
    plain = _llm(base, **options).generate(PROMPTS, params, lora_request=requests)
    spec = _llm(base, **options, speculative_config=DRAFTERS["ngram"])
    drafted = spec.generate(PROMPTS, params, lora_request=requests)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    for out in plain:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
