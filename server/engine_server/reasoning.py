"""Reasoning parsers for the ``<think>…</think>`` family, under vLLM's names:
``deepseek_r1`` (the chat template opens ``<think>``, so the output starts inside the
reasoning, which ends at ``</think>``) and ``qwen3`` (reasoning only when the output opens
``<think>`` itself: with ``enable_thinking=False`` everything is the answer)."""

from __future__ import annotations

from engine.interfaces import ReasoningMarkers, ReasoningParser

OPEN, CLOSE = "<think>", "</think>"


def _held(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that could begin ``marker``."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)


class ThinkReasoningParser(ReasoningParser):
    """Reasoning between ``<think>`` and ``</think>``; the answer after it. ``starts_inside``:
    the prompt already opened ``<think>`` (an opening tag in the output is then skipped too)."""

    starts_inside = True

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.buffer = ""
        self.state = "start"  # start -> reasoning -> content

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning = []
        if self.state == "start":
            head = self.buffer.lstrip()
            if OPEN.startswith(head) and len(head) < len(OPEN):
                return "", ""  # may still be the opening tag
            if head.startswith(OPEN):
                self.buffer, self.state = head[len(OPEN) :], "reasoning"
            elif self.starts_inside:
                self.state = "reasoning"
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = self.buffer.find(CLOSE)
            if end == -1:
                keep = _held(self.buffer, CLOSE)
                piece, self.buffer = (
                    self.buffer[: len(self.buffer) - keep],
                    self.buffer[len(self.buffer) - keep :],
                )
                return piece, ""
            reasoning.append(self.buffer[:end])
            self.buffer, self.state = self.buffer[end + len(CLOSE) :], "content"
        content, self.buffer = self.buffer, ""
        return "".join(reasoning), content

    def grammar_markers(self) -> ReasoningMarkers | None:
        """``<think>`` and ``</think>`` where each is one token of the tokenizer (as in
        DeepSeek-R1's and Qwen3's)."""
        start, end = (self.tokenizer.encode(m, add_special_tokens=False) for m in (OPEN, CLOSE))
        if len(start) != 1 or len(end) != 1:
            return None
        return ReasoningMarkers(start[0], end[0], self.starts_inside)

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning" or (self.state == "start" and self.starts_inside):
            return rest.removeprefix(OPEN) if self.state == "start" else rest, ""
        return "", rest


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    starts_inside = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    starts_inside = False
