"""The output items of a ``/v1/responses`` answer, built from the chat deltas that
:class:`engine_server.tools.ChatOutput` makes of the generated text (``reasoning_content``,
``content``, ``tool_calls``), and the stream events that build them: the same code makes a
stream and a whole response, so the two cannot disagree. Items come in the order the text
gives them: a ``reasoning`` item, a ``message`` with one ``output_text`` part, then one
``function_call`` item per call; a change of kind closes the item before it."""

from __future__ import annotations

import copy
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    def __init__(self):
        self.items: list[dict] = []
        self._open: dict | None = None  # the item being written

    def feed(self, deltas: list[dict]) -> list[dict]:
        """The events (without sequence numbers) for a list of chat deltas."""
        events: list[dict] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._write("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._write("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
        return events

    def close(self, status: str = "completed") -> list[dict]:
        """End the open item (``status``: ``incomplete`` when the output was cut off)."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            done = {"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]}
            return [done, self._item_event("done", item)]
        part = item["content"][0]
        text = {
            "type": f"response.{_PART[item['type']]}.done",
            **where,
            "content_index": 0,
            "text": part["text"],
            **({"logprobs": []} if item["type"] == "message" else {}),
        }
        part_done = {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)}
        return [text, part_done, self._item_event("done", item)]

    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self.close()
            events += self._start(kind)
        part = self._open["content"][0]
        part["text"] += text
        delta = {
            "type": f"response.{_PART[kind]}.delta",
            "item_id": self._open["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
            "delta": text,
            **({"logprobs": []} if kind == "message" else {}),
        }
        return events + [delta]

    def _start(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        item["content"] = []
        self._open = item
        self.items.append(item)
        added = self._item_event("added", item)
        item["content"].append(part)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        return [added, {"type": "response.content_part.added", **where, "part": dict(part)}]

    def _call(self, call: dict) -> list[dict]:
        """A tool-call delta: one with an ``id`` starts a call, the others add to its arguments."""
        function = call.get("function") or {}
        events = []
        if "id" in call:
            events += self.close()
            item = {
                "id": new_id("fc"),
                "type": "function_call",
                "call_id": call["id"],
                "name": function.get("name", ""),
                "arguments": "",
                "status": "in_progress",
            }
            self._open = item
            self.items.append(item)
            events.append(self._item_event("added", item))
        arguments = function.get("arguments") or ""
        if arguments and self._open is not None:
            self._open["arguments"] += arguments
            events.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": self._open["id"],
                    "output_index": len(self.items) - 1,
                    "delta": arguments,
                }
            )
        return events

    def _item_event(self, what: str, item: dict) -> dict:
        """``response.output_item.added`` / ``.done`` with a copy of the item as it is now (the
        item written is always the last)."""
        return {
            "type": f"response.output_item.{what}",
            "output_index": len(self.items) - 1,
            "item": copy.deepcopy(item),
        }


_PART = {"message": "output_text", "reasoning": "reasoning_text"}
