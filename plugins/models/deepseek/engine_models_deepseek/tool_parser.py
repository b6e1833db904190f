"""``deepseek_v3``: DeepSeek-V3's tool calls (vLLM's name), as its chat template writes them::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

one ``<｜tool▁call▁begin｜>`` ... ``<｜tool▁call▁end｜>`` per call, after any content. A call's
arguments are its JSON text as the model wrote it (checked to be JSON), streamed as it arrives."""

from __future__ import annotations

import json
import re

from engine.interfaces import MarkedToolParser, ToolCall, marker_tail

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
HEAD = re.compile(r"\s*<｜tool▁call▁begin｜>(\w+)<｜tool▁sep｜>([^\n]+)\n")
FENCE = re.compile(r"```(?:json)?\n")
CALL_END = "\n```<｜tool▁call▁end｜>"


class DeepSeekV3ToolParser(MarkedToolParser):
    markers = ((CALLS_BEGIN, False),)
    anywhere = True

    def parse_calls(self, text):
        text = text.removesuffix(CALLS_END).strip()
        calls, end = self._scan(text)
        try:
            for call in calls:
                json.loads(call.arguments)
        except ValueError:
            return None
        return calls if calls and end == len(text) else None

    def partial_calls(self, text):
        return self._scan(text)[0]

    @staticmethod
    def _scan(text: str) -> tuple[list[ToolCall], int | None]:
        """The function calls begun in ``text``, each with its arguments as far as they have
        arrived (less what may be the start of the call's end), and where the last complete
        call ends (None when one is still open). Calls of another kind than ``function`` are
        skipped."""
        calls, at = [], 0
        while head := HEAD.match(text, at):
            kind, name = head.group(1), head.group(2).strip()
            fence = FENCE.match(text, head.end())
            start = fence.end() if fence else len(text)
            end = text.find(CALL_END, start) if fence else -1
            stop = end if end != -1 else len(text) - marker_tail(text[start:], (CALL_END,))
            if kind == "function":
                calls.append(ToolCall(name, text[start:stop] if fence else ""))
            if end == -1:
                return calls, None
            at = end + len(CALL_END)
        return calls, at
