"""A chat generation's answer in Anthropic's shape. The chat route's per-choice output
(:class:`engine_server.tools.ChatOutput`: text, reasoning and tool-call deltas) becomes
content-block events (:class:`Blocks`); a stream sends them as they come, between
``message_start`` and ``message_delta`` / ``message_stop``, and a whole message is those same
events folded into its content blocks, so both ways give the same answer."""

from __future__ import annotations

import json
import uuid

from engine.client import SequenceOutput
from engine_server.errors import APIError
from engine_server.generation import Generation


def event(payload: dict) -> str:
    """One SSE event, named by its payload's type as Anthropic names them."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"


class Blocks:
    """Turns ChatOutput deltas into content-block events: a block opens when the kind of
    output changes (thinking, text, a new tool call) and closes when the next one opens."""

    def __init__(self):
        self.index, self.kind = -1, None

    def feed(self, deltas: list[dict]) -> list[dict]:
        events: list[dict] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                if self.kind != "thinking":
                    events += self._open({"type": "thinking", "thinking": "", "signature": ""})
                events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                if self.kind != "text":
                    events += self._open({"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls", ()):
                function = call["function"]
                if "id" in call:  # a new call; without an id, more of the current one's arguments
                    events += self._open(
                        {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
                    )
                if function.get("arguments"):
                    events.append(
                        self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
                    )
        return events

    def close(self) -> list[dict]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _open(self, block: dict) -> list[dict]:
        events = self.close()
        self.index, self.kind = self.index + 1, block["type"]
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}


def content(events: list[dict]) -> list[dict]:
    """The content blocks the events build, as a client accumulates them; a tool call's
    arguments that are not a JSON object (cut off by max_tokens) give an empty input."""
    blocks: list[dict] = []
    arguments: dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            delta, block = e["delta"], blocks[e["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                arguments[e["index"]] = arguments.get(e["index"], "") + delta["partial_json"]
    for index, text in arguments.items():
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        blocks[index]["input"] = value if isinstance(value, dict) else {}
    return blocks


def stop_reason(choice: SequenceOutput, finish_reason: str | None) -> tuple[str | None, str | None]:
    """-> (stop_reason, stop_sequence) for the chat route's finish_reason of ``choice``."""
    if finish_reason is None:
        return None, None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


class AnthropicGeneration(Generation):
    """A chat :class:`Generation` (one choice) answered as an Anthropic message."""

    keepalive_frame = event({"type": "ping"})
    done_frame = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.blocks = Blocks()

    @property
    def _choice(self) -> SequenceOutput:
        return self.choices[0]

    def _stop(self) -> dict:
        choice = self._choice
        reason, sequence = stop_reason(
            choice, self.outputs[choice.request_id].finish_reason(choice.finish_reason)
        )
        return {"stop_reason": reason, "stop_sequence": sequence}

    def _message(self, blocks: list[dict], output_tokens: int, stop: dict) -> dict:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": blocks,
            **stop,
            "usage": {"input_tokens": len(self.prompts[0][1]), "output_tokens": output_tokens},
        }

    def _response(self) -> dict:
        choice = self._choice
        output = self.outputs[choice.request_id]
        events = self.blocks.feed(output.on_text(choice.text) + output.on_finish()) + self.blocks.close()
        return self._message(content(events), len(choice.token_ids), self._stop())

    # -- a stream ----------------------------------------------------------------------
    def _error_frame(self, error: APIError) -> str:
        return event(error.anthropic_body())

    def _opening_frames(self) -> list[str]:
        start = self._message([], 0, {"stop_reason": None, "stop_sequence": None})
        return [event({"type": "message_start", "message": start})]

    def _chunks(self, choice: SequenceOutput, text: str, entries: list, first: bool = False) -> list[str]:
        output = self.outputs[choice.request_id]
        deltas = (output.on_text(text) if text else []) + (output.on_finish() if choice.finish_reason else [])
        events = self.blocks.feed(deltas) + (self.blocks.close() if choice.finish_reason else [])
        return [event(e) for e in events]

    def _closing_frames(self, failed: bool) -> list[str]:
        if failed:
            return []
        usage = {"output_tokens": len(self._choice.token_ids)}
        return [
            event({"type": "message_delta", "delta": self._stop(), "usage": usage}),
            event({"type": "message_stop"}),
        ]
