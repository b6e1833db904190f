"""Tool calling: the Hermes-style parser (what SmolLM2-Instruct and Hermes/Qwen-style models
emit), the schema grammars that enforce ``tool_choice="required"`` and named calls, and how
each mode turns generated text into OpenAI message and stream deltas."""

from __future__ import annotations

import json
import uuid

from engine.interfaces import (
    ArgumentsDelta,
    CallPieces,
    GrammarSpec,
    ReasoningParser,
    ToolCall,
    ToolParser,
    marker_tail,
)
from engine_server.errors import bad_request
from engine_server.validation import check_json_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks between content."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.buffer, self.inside = "", False

    def system_prompt(self, tools: list[dict]) -> str:
        signatures = "\n".join(json.dumps(t) for t in tools)
        return (
            "You are a function calling AI model. You are provided with function signatures within "
            "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
            "Don't make assumptions about what values to plug into functions. Here are the available "
            f"tools: <tools>\n{signatures}\n</tools>\nFor each function call return a json object with "
            "function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-dict>}\n</tool_call>'
        )

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        content, calls = [], []
        while True:
            if not self.inside:
                start = self.buffer.find(OPEN)
                if start == -1:
                    keep = marker_tail(self.buffer, (OPEN,))
                    content.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                content.append(self.buffer[:start])
                self.buffer, self.inside = self.buffer[start + len(OPEN) :], True
            else:
                end = self.buffer.find(CLOSE)
                if end == -1:
                    break
                call = self._parse(self.buffer[:end])
                if call is None:
                    content.append(OPEN + self.buffer[: end + len(CLOSE)])
                else:
                    calls.append(call)
                self.buffer, self.inside = self.buffer[end + len(CLOSE) :], False
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        if self.inside:
            call = self._parse(rest)
            return ("", [call]) if call else (OPEN + rest, [])
        return rest, []

    @staticmethod
    def _parse(body: str) -> ToolCall | None:
        try:
            data = json.loads(body.strip())
            arguments = data.get("arguments", data.get("parameters", {}))
            return ToolCall(data["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def check_tools(tools: list[dict] | None, tool_choice) -> tuple[str, dict[str, dict]]:
    """-> (mode, tools by name); mode is "none", "auto", "required" or "named:<name>".
    Each tool's ``parameters`` must be a valid JSON schema object (they become grammars)."""
    by_name = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function")
        if (
            tool.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise bad_request(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools"
            )
        if function.get("parameters") is not None:
            check_json_schema(function["parameters"], "tools", f"tools[{i}].function.parameters")
        by_name[function["name"]] = function
    if tool_choice is None:
        return ("auto" if by_name else "none"), by_name
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request(
                "a named tool_choice must be {'type': 'function', 'function': {'name': ...}}", "tool_choice"
            )
        if name not in by_name:
            raise bad_request(
                f"tool_choice names {name!r}, which is not among the tools "
                f"({', '.join(by_name) or 'none given'})",
                "tool_choice",
            )
        return f"named:{name}", by_name
    if tool_choice not in ("none", "auto", "required"):
        raise bad_request(
            f"tool_choice must be none, auto, required or a named function; got {tool_choice!r}",
            "tool_choice",
        )
    if tool_choice == "required" and not by_name:
        raise bad_request("tool_choice=required needs at least one tool", "tool_choice")
    return tool_choice, by_name


def tool_grammar(mode: str, tools: dict[str, dict], parallel: bool) -> GrammarSpec | None:
    """The schema that forces a call: a named tool's arguments, or a non-empty array of
    ``{"name", "arguments"}`` objects over all tools (one at most without parallel calls)."""
    if mode.startswith("named:"):
        return GrammarSpec("json", tools[mode[6:]].get("parameters") or {"type": "object"})
    if mode != "required":
        return None
    options = [
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "arguments"],
            "properties": {
                "name": {"enum": [name]},
                "arguments": function.get("parameters") or {"type": "object"},
            },
        }
        for name, function in tools.items()
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    return GrammarSpec("json", schema)


def _call_delta(index: int, call: ToolCall) -> dict:
    return {
        "index": index,
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


class ChatOutput:
    """How one chat choice's text becomes OpenAI message content and stream deltas. With a
    reasoning parser, its reasoning goes to ``reasoning_content`` and only the answer after
    it is content (and parsed for tool calls)."""

    def __init__(
        self, mode: str, parser: ToolParser | None, parallel: bool, reasoning: ReasoningParser | None = None
    ):
        self.mode, self.parser, self.parallel, self.reasoning = mode, parser, parallel, reasoning
        self.calls: list[ToolCall] = []  # as far as they have been given
        self._dropping = False  # the call being streamed is past the first, without parallel calls
        self._text = ""
        self._named_id = f"call_{uuid.uuid4().hex[:24]}"

    def on_text(self, text: str) -> list[dict]:
        if self.reasoning is None:
            return self._answer(text)
        return self._split(*self.reasoning.feed(text))

    def on_finish(self) -> list[dict]:
        tail = self._split(*self.reasoning.finish()) if self.reasoning is not None else []
        return tail + self._finish_answer()

    def _split(self, thought: str, answer: str) -> list[dict]:
        return ([{"reasoning_content": thought}] if thought else []) + (
            self._answer(answer) if answer else []
        )

    def _answer(self, text: str) -> list[dict]:
        self._text += text
        if self.mode.startswith("named:"):
            first = not self.calls
            if first:
                self.calls.append(ToolCall(self.mode[6:], ""))
            head = {
                "id": self._named_id,
                "type": "function",
                "function": {"name": self.mode[6:], "arguments": text},
            }
            return [{"tool_calls": [{"index": 0, **(head if first else {"function": {"arguments": text}})}]}]
        if self.mode == "required":
            return []  # emitted whole once the array is complete
        if self.mode == "auto" and self.parser is not None:
            content, calls = self.parser.feed(text)
            return self._deltas(content, calls)
        return [{"content": text}]

    def _finish_answer(self) -> list[dict]:
        if self.mode == "required":
            return self._deltas("", self._required_calls())
        if self.mode == "auto" and self.parser is not None:
            return self._deltas(*self.parser.finish())
        return []

    def _deltas(self, content: str, pieces: CallPieces) -> list[dict]:
        """Content, then a delta per call piece: a :class:`ToolCall` begins a call (with an id),
        an :class:`ArgumentsDelta` adds to the last one's arguments. Without parallel calls,
        every call after the first is dropped, its arguments with it."""
        out = [{"content": content}] if content else []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                self._dropping = not self.parallel and bool(self.calls)
                if not self._dropping:
                    out.append({"tool_calls": [_call_delta(len(self.calls), piece)]})
                    self.calls.append(piece)
            elif isinstance(piece, ArgumentsDelta) and not self._dropping and piece.arguments:
                last = self.calls[-1]
                self.calls[-1] = ToolCall(last.name, last.arguments + piece.arguments)
                delta = {"index": len(self.calls) - 1, "function": {"arguments": piece.arguments}}
                out.append({"tool_calls": [delta]})
        return out

    def _required_calls(self) -> list[ToolCall]:
        try:
            items = json.loads(self._text)
            return [ToolCall(i["name"], json.dumps(i["arguments"])) for i in items]
        except (ValueError, KeyError, TypeError):
            return []  # cut off by max_tokens: no complete call

    def message(self, text: str) -> dict:
        """The non-streaming message for the whole text."""
        deltas = self.on_text(text) + self.on_finish()
        content = "".join(d.get("content", "") for d in deltas)
        message = {"role": "assistant", "content": content or (None if self.calls else "")}
        if self.reasoning is not None:
            message["reasoning_content"] = "".join(d.get("reasoning_content", "") for d in deltas) or None
        if self.mode.startswith("named:"):
            message["content"] = None
            message["tool_calls"] = [
                {
                    "id": self._named_id,
                    "type": "function",
                    "function": {"name": self.mode[6:], "arguments": self._text},
                }
            ]
        elif self.calls:
            begun = [d["tool_calls"][0] for d in deltas if "id" in d.get("tool_calls", [{}])[0]]
            message["tool_calls"] = [
                {**head, "function": {"name": call.name, "arguments": call.arguments}}
                for head, call in zip(begun, self.calls, strict=True)
            ]
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason
