"""``deepseek_v3``: DeepSeek-V3's tool calls (vLLM's name), as its chat template writes them::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

one ``<｜tool▁call▁begin｜>`` ... ``<｜tool▁call▁end｜>`` per call, after any content."""

from __future__ import annotations

import json
import re

from engine.interfaces import MarkedToolParser, ToolCall

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL = re.compile(
    r"<｜tool▁call▁begin｜>(\w+)<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\n```<｜tool▁call▁end｜>",
    re.DOTALL,
)


class DeepSeekV3ToolParser(MarkedToolParser):
    markers = ((CALLS_BEGIN, False),)
    anywhere = True

    def parse_calls(self, text):
        text = text.removesuffix(CALLS_END).strip()
        try:
            calls = [
                ToolCall(name.strip(), json.dumps(json.loads(arguments), ensure_ascii=False))
                for kind, name, arguments in CALL.findall(text)
                if kind == "function"
            ]
        except ValueError:
            return None
        if not calls or CALL.sub("", text).strip():
            return None
        return calls
