"""Both grammar backends end to end: greedy generation on the tiny Llama under a JSON schema, a
regex, a choice list and a grammar (GBNF on both, Lark on llguidance) gives output that
matches; ``auto`` falls back, per request, to llguidance for what xgrammar refuses (a schema,
a Lark grammar) and says so in the log; vLLM's spellings select the backend."""

from __future__ import annotations

import json
import logging
import re
import unicodedata

import jsonschema
import pytest

from engine import LLM, GrammarSpec, SamplingParams
from engine.config import EngineConfig
from engine.entrypoints.cli_args import ArgumentParser, add_engine_arguments, engine_options
from engine.interfaces import GrammarBackend

pytest.importorskip("engine_grammar_xgrammar", reason="the xgrammar plugin is not installed")
pytest.importorskip("engine_grammar_llguidance", reason="the llguidance plugin is not installed")

PROMPTS = ["Give me a record:", "Once upon a time", "The answer is"]
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["color", "n", "ok"],
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
}
REGEX = r"(Mon|Tue|Wed) [0-2][0-9]:[0-5][0-9]"
CHOICES = ["yes", "no", "it depends"]
GBNF = 'root ::= "(" [0-9] [0-9]? ")" | "none"'
LARK = 'start: "(" DIGIT DIGIT? ")" | "none"\nDIGIT: /[0-9]/'
GRAMMAR_OUTPUT = re.compile(r"\(\d\d?\)|none")
# xgrammar 0.2.9 refuses Unicode property classes in a pattern; llguidance compiles them
XGRAMMAR_REFUSES = {"type": "string", "pattern": "^\\p{Lu}{2}$"}
CASES = {
    "json": (GrammarSpec("json", SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    "regex": (GrammarSpec("regex", REGEX), lambda t: re.fullmatch(REGEX, t)),
    "choice": (GrammarSpec("choice", CHOICES), lambda t: t in CHOICES),
    "gbnf": (GrammarSpec("grammar", GBNF), GRAMMAR_OUTPUT.fullmatch),
}


def _llm(tiny_llama, backend: str) -> LLM:
    return LLM(
        tiny_llama[0], dtype="float32", num_blocks=64, max_model_len=256, structured_outputs_backend=backend
    )


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend_llm(request, tiny_llama):
    return request.param, _llm(tiny_llama, request.param)


@pytest.fixture(scope="module")
def auto_llm(tiny_llama):
    return _llm(tiny_llama, "auto")


def _texts(llm, spec: GrammarSpec, max_tokens: int = 48) -> list:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)
    return [out.outputs[0] for out in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("kind", sorted(CASES))
def test_greedy_output_matches(backend_llm, kind):
    name, llm = backend_llm
    spec, check = CASES[kind]
    for out in _texts(llm, spec):
        assert out.finish_reason == "stop", f"{name}: {out.text!r} did not finish"
        assert check(out.text), f"{name}: {out.text!r} does not match {spec.value!r}"


def test_lark_grammar_on_llguidance_and_refused_by_xgrammar(backend_llm):
    name, llm = backend_llm
    outputs = _texts(llm, GrammarSpec("grammar", LARK))
    if name == "xgrammar":  # GBNF only: the request fails, the engine goes on
        assert all(out.finish_reason == "error" for out in outputs)
        return
    for out in outputs:
        assert out.finish_reason == "stop" and GRAMMAR_OUTPUT.fullmatch(out.text), out.text


def _two_capitals(value) -> bool:
    """``^\\p{Lu}{2}$`` (Python's ``re``, which jsonschema uses, has no ``\\p``)."""
    return isinstance(value, str) and len(value) == 2 and all(unicodedata.category(c) == "Lu" for c in value)


@pytest.mark.parametrize(
    "spec, check",
    [
        (GrammarSpec("json", XGRAMMAR_REFUSES), lambda t: _two_capitals(json.loads(t))),
        (GrammarSpec("grammar", LARK), GRAMMAR_OUTPUT.fullmatch),
    ],
    ids=["schema", "lark"],
)
def test_auto_falls_back_to_llguidance_and_says_so(auto_llm, caplog, spec, check):
    with caplog.at_level(logging.INFO, logger="engine.core.structured"):
        outputs = _texts(auto_llm, spec, max_tokens=96)
    for out in outputs:
        assert out.finish_reason == "stop" and check(out.text), out.text
    refused = [r for r in caplog.messages if "grammar backend xgrammar cannot compile" in r]
    fallbacks = [r for r in caplog.messages if "compiled by llguidance (fallback)" in r]
    assert len(refused) == len(fallbacks) == len(PROMPTS), caplog.messages


def test_auto_uses_xgrammar_first(auto_llm, caplog):
    with caplog.at_level(logging.INFO, logger="engine.core.structured"):
        outputs = _texts(auto_llm, CASES["choice"][0])
    assert all(out.text in CHOICES for out in outputs)
    assert not [r for r in caplog.messages if "fallback" in r or "cannot compile" in r]


def test_auto_fails_a_request_no_backend_compiles_with_every_reason(auto_llm):
    (out,) = [
        o.outputs[0]
        for o in auto_llm.generate(
            PROMPTS[:1], SamplingParams(max_tokens=4, structured_outputs=GrammarSpec("regex", "([a-z"))
        )
    ]
    assert out.finish_reason == "error"


@pytest.mark.parametrize(
    "options, backend",
    [
        ({"structured_outputs_config": {"backend": "llguidance"}}, "llguidance"),
        ({"structured_outputs_config": '{"backend": "guidance"}'}, "llguidance"),
        ({"guided_decoding_backend": "xgrammar"}, "xgrammar"),
        ({"guided_decoding_backend": "auto", "structured_outputs_config": {"backend": "auto"}}, "auto"),
    ],
)
def test_vllm_spellings_select_the_backend(options, backend):
    assert EngineConfig.from_kwargs(**options).structured_outputs_backend == backend


@pytest.mark.parametrize(
    "argv, backend",
    [
        (["--structured-outputs-config", '{"backend": "llguidance"}'], "llguidance"),
        (
            ["--structured-outputs-config", '{"backend": "guidance", "disable_any_whitespace": true}'],
            "llguidance",
        ),
        (["--guided-decoding-backend", "llguidance"], "llguidance"),
        (["--structured-outputs-config.backend", "guidance"], "llguidance"),
        (["--grammar-backend", "xgrammar"], "xgrammar"),
        (["--structured-outputs-backend", "auto"], "auto"),
    ],
)
def test_vllm_and_sglang_flags_select_the_backend(argv, backend):
    parser = ArgumentParser()
    add_engine_arguments(parser)
    options = engine_options(parser.parse_args(argv))
    assert EngineConfig.from_kwargs(**options).structured_outputs_backend == backend


@pytest.mark.parametrize(
    "options, message",
    [
        ({"structured_outputs_config": {"backend": "xgrammar", "bogus": 1}}, "unknown key.*bogus"),
        ({"structured_outputs_backend": "xgrammar", "guided_decoding_backend": "llguidance"}, "conflicting"),
        ({"structured_outputs_config": {"backend": "auto", "disable_fallback": True}}, "disable_fallback"),
    ],
)
def test_bad_structured_outputs_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**options)


def test_auto_leaves_out_a_backend_that_cannot_be_built(tiny_llama, caplog):
    """A backend whose constructor refuses the model (llguidance with a slow tokenizer) is left
    out of auto with a warning; the others still serve. Named alone, its error stands."""
    from engine import load_tokenizer
    from engine.core.structured import StructuredOutputs
    from engine.interfaces import GrammarContext
    from engine.plugins import load_plugins

    class Unbuildable(GrammarBackend):
        def __init__(self, ctx):
            raise ValueError("needs a fast tokenizer")

        def compile(self, spec):
            raise AssertionError("never built")

    _, tokenizer = load_tokenizer(tiny_llama[0])
    ctx = GrammarContext(tokenizer, len(tokenizer))
    xgrammar = load_plugins().get("grammar_backends", "xgrammar")
    with caplog.at_level(logging.WARNING, logger="engine.core.structured"):
        structured = StructuredOutputs({"unbuildable": Unbuildable, "xgrammar": xgrammar}, ctx)
    assert list(structured.backends) == ["xgrammar"]
    assert any("unbuildable left out of auto: needs a fast tokenizer" in m for m in caplog.messages)
    structured.shutdown()
    with pytest.raises(ValueError, match="fast tokenizer"):
        StructuredOutputs({"unbuildable": Unbuildable}, ctx)
