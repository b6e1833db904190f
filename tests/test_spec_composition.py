"""Speculation composes with structured outputs (each grammar backend), penalties and seeds:
greedy constrained output with drafts equals the output without, and sampled constrained
output stays valid."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, GrammarSpec, SamplingParams

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["items"],
    "properties": {
        "items": {"type": "array", "minItems": 3, "maxItems": 6, "items": {"enum": ["apple", "pear", "plum"]}}
    },
}


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_grammar_with_drafts_equals_grammar_without(tiny_llama, backend):
    """Each backend's accept and rollback of drafts, in the engine: drafts change nothing."""
    pytest.importorskip(f"engine_grammar_{backend}", reason=f"the {backend} plugin is not installed")
    folder = tiny_llama[0]
    options = dict(dtype="float32", num_blocks=128, max_model_len=512, structured_outputs_backend=backend)
    example = 'Example: {"items": ["apple", "pear", "plum", "apple"]}. '
    prompts = [example + "List fruit:", example + "Fruit basket:", example + "More fruit please:"]
    greedy = SamplingParams(
        max_tokens=60, temperature=0, repetition_penalty=1.2, structured_outputs=GrammarSpec("json", SCHEMA)
    )
    plain = [o.outputs[0] for o in LLM(folder, **options).generate(prompts, greedy)]
    spec = LLM(
        folder,
        **options,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    )
    drafted = [o.outputs[0] for o in spec.generate(prompts, greedy)]
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert spec.engine.stats()["spec_draft_tokens"] > 0
    sampled = spec.generate(
        prompts * 4,
        SamplingParams(
            max_tokens=60, temperature=1.0, seed=3, structured_outputs=GrammarSpec("json", SCHEMA)
        ),
    )
    for out in sampled:
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
