"""The <think> reasoning parsers on whole outputs and streamed in every split."""

from __future__ import annotations

import pytest

from engine_server.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

CASES = [
    (
        DeepSeekR1ReasoningParser,
        "Let me think. 2+2=4.</think>\n\nThe answer is 4.",
        "Let me think. 2+2=4.",
        "\n\nThe answer is 4.",
    ),  # as generated after the tag, as vLLM returns it
    (DeepSeekR1ReasoningParser, "<think>Hmm.</think>Four.", "Hmm.", "Four."),
    (DeepSeekR1ReasoningParser, "Still thinking when cut off", "Still thinking when cut off", ""),
    (Qwen3ReasoningParser, "<think>\nShort.\n</think>\n\nFour.", "\nShort.\n", "\n\nFour."),
    (Qwen3ReasoningParser, "Four, without thinking.", "", "Four, without thinking."),
    (Qwen3ReasoningParser, "<think>cut", "cut", ""),
    (Qwen3ReasoningParser, "<thin", "", "<thin"),
]


@pytest.mark.parametrize(("parser_cls", "output", "reasoning", "content"), CASES)
def test_split_reasoning_and_content(parser_cls, output, reasoning, content):
    for pieces in [[output], list(output)] + [[output[:i], output[i:]] for i in range(1, len(output))]:
        parser = parser_cls(tokenizer=None)
        got = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert "".join(r for r, _ in got) == reasoning, pieces
        assert "".join(c for _, c in got) == content, pieces


def test_reasoning_streams_as_it_comes():
    parser = DeepSeekR1ReasoningParser(tokenizer=None)
    assert parser.feed("First, ") == ("First, ", "")
    assert parser.feed("then </thi") == ("then ", "")
    assert parser.feed("nk>Done") == ("", "Done")
