"""The reasoning-aware grammar (engine.core.reasoning_gate) by construction, on both grammar
backends and the kit's tiny tokenizer: the mask is off (every word -1) inside the reasoning,
exactly the backend's after the end marker, the backend's plus the opening marker where the
output may open reasoning (qwen3); rollback across the marker, EOS inside the reasoning."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from engine.core.reasoning_gate import ReasoningGate, reasoning_markers
from engine.interfaces import GrammarContext, GrammarSpec, ReasoningMarkers
from engine.plugins import load_plugins
from engine.testing.grammar import PADDING_IDS, SCHEMA, allowed_ids, engine_row
from engine.testing.tiny_tokenizer import tiny_tokenizer

SPEC = GrammarSpec("json", SCHEMA)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request, tokenizer):
    cls = load_plugins().get("grammar_backends", request.param)
    return cls(GrammarContext(tokenizer, len(tokenizer) + PADDING_IDS))


def markers(tokenizer, starts_inside: bool) -> ReasoningMarkers:
    """Two single tokens of the tiny tokenizer stand for <think> and </think>."""
    start, end = tokenizer.convert_tokens_to_ids(["deep", "green"])
    return ReasoningMarkers(start, end, starts_inside)


def gate(backend, tokenizer, starts_inside: bool) -> ReasoningGate:
    return ReasoningGate(backend.compile(SPEC), markers(tokenizer, starts_inside), tokenizer.eos_token_id)


def vocab(tokenizer) -> int:
    return len(tokenizer) + PADDING_IDS


def test_free_inside_the_reasoning_and_the_grammar_after_it(backend, tokenizer):
    mark, size = markers(tokenizer, True), vocab(tokenizer)
    grammar, plain = gate(backend, tokenizer, True), backend.compile(SPEC)
    thinking = tokenizer.encode("hmm, [not json} at all")
    for token in thinking:
        assert (engine_row(grammar, size) == -1).all(), "the mask must be off inside the reasoning"
        assert grammar.accept_tokens([token]) and not grammar.is_terminated()
    assert grammar.accept_tokens([mark.end])
    assert torch.equal(engine_row(grammar, size), engine_row(plain, size)), (
        "after </think>: the grammar's mask"
    )
    assert not grammar.accept_tokens(tokenizer.encode("hmm")), "after </think> the grammar refuses non-JSON"
    answer = tokenizer.encode('{"name": "ab", "n": 7, "tags": ["red"]}')
    assert grammar.accept_tokens(answer) and plain.accept_tokens(answer)
    assert torch.equal(engine_row(grammar, size), engine_row(plain, size))
    assert grammar.accept_tokens([tokenizer.eos_token_id]) and grammar.is_terminated()


def test_rollback_across_the_end_marker(backend, tokenizer):
    mark, size = markers(tokenizer, True), vocab(tokenizer)
    grammar = gate(backend, tokenizer, True)
    assert grammar.accept_tokens([*tokenizer.encode("ok"), mark.end, *tokenizer.encode('{"name')])
    grammar.rollback(len(tokenizer.encode('{"name')))
    after_marker = engine_row(grammar, size)
    grammar.rollback(1)
    assert (engine_row(grammar, size) == -1).all(), "rolled back before </think>: the mask is off again"
    assert grammar.accept_tokens(tokenizer.encode(" more") + [mark.end])
    assert torch.equal(engine_row(grammar, size), after_marker)
    grammar.reset()
    assert (engine_row(grammar, size) == -1).all()


def test_eos_inside_the_reasoning_ends_it(backend, tokenizer):
    grammar = gate(backend, tokenizer, True)
    eos = tokenizer.eos_token_id
    assert grammar.accept_tokens([*tokenizer.encode("thinking"), eos]) and grammar.is_terminated()
    assert not grammar.accept_tokens([eos])
    grammar.rollback(1)
    assert not grammar.is_terminated()


def test_an_output_that_may_open_reasoning(backend, tokenizer):
    """qwen3: the first mask is the grammar's and the opening marker; the answer is at once
    the grammar's, or the marker opens free reasoning."""
    mark, size = markers(tokenizer, False), vocab(tokenizer)
    grammar, plain = gate(backend, tokenizer, False), backend.compile(SPEC)
    first = set(allowed_ids(engine_row(grammar, size), size))
    assert first == set(allowed_ids(engine_row(plain, size), size)) | {mark.start}
    assert grammar.accept_tokens(
        tokenizer.encode('{"name": "x", "n": 1, "tags": []}') + [tokenizer.eos_token_id]
    )
    assert grammar.is_terminated()
    grammar = gate(backend, tokenizer, False)
    assert grammar.accept_tokens([mark.start, *tokenizer.encode("free text"), mark.end])
    assert torch.equal(engine_row(grammar, size), engine_row(plain, size))


def test_random_walks_give_free_reasoning_then_valid_json(backend, tokenizer):
    mark, size, eos = markers(tokenizer, True), vocab(tokenizer), tokenizer.eos_token_id
    rng = random.Random(0)
    for _ in range(3):
        grammar, tokens = gate(backend, tokenizer, True), []
        while eos not in tokens and len(tokens) < 300:
            allowed = allowed_ids(engine_row(grammar, size), size)
            allowed = [t for t in allowed if t < len(tokenizer) and (mark.end in tokens or t != eos)]
            closers = [t for t in allowed if tokenizer.decode([t])[-1:] in '"}]' or t in (eos, mark.end)]
            token = rng.choice(closers if closers and rng.random() < 0.5 else allowed)
            assert grammar.accept_tokens([token])
            tokens.append(token)
        assert grammar.is_terminated()
        answer = tokenizer.decode(tokens[tokens.index(mark.end) + 1 : -1])
        jsonschema.validate(json.loads(answer), SCHEMA)


def test_vllm_structured_outputs_config_sets_the_reasoning_options():
    from engine.config import EngineConfig

    config = EngineConfig.from_kwargs(
        structured_outputs_config={"reasoning_parser": "qwen3", "enable_in_reasoning": True}
    )
    assert (config.reasoning_parser, config.enable_in_reasoning) == ("qwen3", True)
    assert reasoning_markers(load_plugins(), config, None) is None, "enable_in_reasoning: no gate"
    with pytest.raises(ValueError, match="conflicting reasoning_parser"):
        EngineConfig.from_kwargs(
            reasoning_parser="qwen3", structured_outputs_config={"reasoning_parser": "x"}
        )


def test_a_v2_backend_is_never_handed_a_structural_tag(tokenizer):
    """Registered for grammar interface v2, before the kind existed: refused with the reason,
    whatever its supports says."""
    from engine.core.structured import StructuredOutputs
    from engine.testing.grammar import STRUCTURAL_TAG

    backend = load_plugins().get("grammar_backends", "xgrammar")
    ctx = GrammarContext(tokenizer, len(tokenizer) + PADDING_IDS)
    structured = StructuredOutputs({"xgrammar": backend}, ctx, apis={"xgrammar": 2})
    try:
        (reason,) = structured._refusals("xgrammar", structured.backends["xgrammar"], STRUCTURAL_TAG)
        assert "v2" in reason and "structural_tag" in reason
        assert not structured._refusals("xgrammar", structured.backends["xgrammar"], SPEC)
    finally:
        structured.shutdown()
