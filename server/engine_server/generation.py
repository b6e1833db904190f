"""`/v1/completions` and `/v1/chat/completions`: validate, tokenize, fan out one engine request
per prompt and sample, then stream SSE chunks or collect one response."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from engine.interfaces import GrammarSpec
from engine.sampling_params import InvalidParam, SamplingParams
from engine_server.choices import Choice
from engine_server.client import EngineDead
from engine_server.errors import APIError, bad_request, overloaded
from engine_server.schemas import ChatCompletionRequest, CompletionRequest
from engine_server.tools import ChatOutput, check_tools, tool_grammar

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 128
MAX_LOGPROBS = 20


async def read_body(request: Request, body_type, max_bytes: int):
    data = await request.body()
    if len(data) > max_bytes:
        raise APIError(413, f"request body of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        return msgspec.json.decode(data, type=body_type)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = message.rsplit("at `$.", 1)[-1].rstrip("`").split("[")[0].split(".")[0] if "at `$." in message else None
        raise bad_request(f"invalid request: {message}", param) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"malformed JSON body: {exc}") from None


def check_model(state, name: str | None) -> None:
    if name is not None and name not in (state.model_name, state.model_path):
        raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")


def check_prompt(state, ids: list[int], max_tokens: int | None, param: str) -> None:
    limit = state.max_model_len
    if not ids:
        raise bad_request("the prompt must contain at least one token", param)
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < state.vocab_size for t in ids):
        raise bad_request(f"token ids must be integers in [0, {state.vocab_size})", param)
    if len(ids) >= limit:
        raise bad_request(f"the prompt has {len(ids)} tokens; this model's context is {limit} tokens "
                          "(max_model_len), with at least one left to generate", param)
    if max_tokens is not None and len(ids) + max_tokens > limit:
        raise bad_request(f"max_tokens={max_tokens} plus the prompt's {len(ids)} tokens exceed the "
                          f"context of {limit} tokens", "max_tokens")


def completion_prompts(tokenizer, prompt) -> list[tuple[str | None, list[int]]]:
    def is_ids(value):
        return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

    if isinstance(prompt, str):
        return [(prompt, tokenizer.encode(prompt))]
    if prompt and is_ids(prompt):
        return [(None, list(prompt))]
    if prompt and all(isinstance(p, str) for p in prompt):
        return [(p, tokenizer.encode(p)) for p in prompt]
    if prompt and all(is_ids(p) for p in prompt):
        return [(None, list(p)) for p in prompt]
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                      "prompt")


def chat_prompt(tokenizer, messages, add_generation_prompt: bool, tools: list[dict] | None = None,
                tool_prompt: str | None = None) -> list[int]:
    """Token ids of the templated conversation. Tools go to the template when it renders
    them; otherwise ``tool_prompt`` (the tool parser's instructions) joins the system message."""
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")
    conversation = []
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {message.role!r}",
                              "messages")
        content = message.content
        if isinstance(content, list):
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(part["text"] for part in content)
        entry = {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
        if message.tool_calls:
            entry["tool_calls"] = message.tool_calls
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        conversation.append(entry)
    if not tokenizer.chat_template:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    template_tools = None
    if tools:
        if "tools" in tokenizer.chat_template:
            template_tools = tools
        elif tool_prompt:
            if conversation[0]["role"] == "system":
                conversation[0] = {**conversation[0], "content": conversation[0]["content"] + "\n\n" + tool_prompt}
            else:
                conversation.insert(0, {"role": "system", "content": tool_prompt})
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                            tokenize=True, tools=template_tools)
    except Exception as exc:  # template errors (roles out of order ...) are the caller's
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def structured_spec(body, chat: bool) -> GrammarSpec | None:
    """One constraint from OpenAI's ``response_format`` or vLLM's ``structured_outputs`` /
    ``guided_*`` fields; more than one is a 400."""
    found: list[tuple[str, GrammarSpec]] = []
    response_format = getattr(body, "response_format", None) if chat else None
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_schema":
            schema = (response_format.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema must be a JSON schema object", "response_format")
            found.append(("response_format", GrammarSpec("json", schema)))
        elif kind == "json_object":
            found.append(("response_format", GrammarSpec("json_object", None)))
        elif kind != "text":
            raise bad_request(f"response_format.type must be text, json_object or json_schema; got {kind!r}",
                              "response_format")
    outputs = body.structured_outputs or {}
    for key in outputs:
        if key not in ("json", "regex", "choice", "grammar", "json_object"):
            raise bad_request(f"structured_outputs.{key} is not one of json, regex, choice, grammar, json_object",
                              "structured_outputs")
    for kind in ("json", "regex", "choice", "grammar"):
        value = outputs.get(kind, getattr(body, f"guided_{kind}"))
        if value is not None:
            found.append((kind, GrammarSpec(kind, value)))
    if outputs.get("json_object"):
        found.append(("json_object", GrammarSpec("json_object", None)))
    if len(found) > 1:
        raise bad_request(f"give one structured-output constraint, not {len(found)}: "
                          f"{', '.join(name for name, _ in found)}", found[1][0])
    return found[0][1] if found else None


def default_max_tokens(state, num_prompt_tokens: int) -> int:
    """max_tokens of a chat request that sets none: what the context leaves, or less when
    the generation config sets ``max_new_tokens``."""
    room = max(1, state.max_model_len - num_prompt_tokens)
    return min(room, state.default_sampling_params.get("max_tokens", room))


def sampling_params(body, max_tokens: int | None, logprobs: int | None, seed: int | None,
                    spec: GrammarSpec | None = None, defaults: dict | None = None) -> SamplingParams:
    """``defaults`` (the model's generation config) fill the sampling fields a request leaves out."""
    defaults = defaults or {}

    def given(value, default):
        return default if value is None else value

    try:
        return SamplingParams(
            temperature=given(body.temperature, defaults.get("temperature", 1.0)),
            top_p=given(body.top_p, defaults.get("top_p", 1.0)), top_k=given(body.top_k, defaults.get("top_k", 0)),
            min_p=given(body.min_p, defaults.get("min_p", 0.0)), frequency_penalty=given(body.frequency_penalty, 0.0),
            presence_penalty=given(body.presence_penalty, 0.0),
            repetition_penalty=given(body.repetition_penalty, defaults.get("repetition_penalty", 1.0)), seed=seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens, stop=body.stop or (), stop_token_ids=body.stop_token_ids or (),
            include_stop_str_in_output=body.include_stop_str_in_output, ignore_eos=body.ignore_eos,
            logprobs=logprobs, skip_special_tokens=body.skip_special_tokens, structured_outputs=spec)
    except InvalidParam as exc:
        raise bad_request(str(exc), exc.param) from None


class Generation:
    """One HTTP request's fan-out: a choice per (prompt, sample) and their engine requests."""

    def __init__(self, state, body, prompts, max_tokens, logprobs, chat: bool, spec: GrammarSpec | None = None,
                 make_output=None):
        if not 1 <= body.n <= MAX_N:
            raise bad_request(f"n must be in [1, {MAX_N}], got {body.n}", "n")
        self.state, self.body, self.prompts, self.chat = state, body, prompts, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices: list[Choice] = []
        children = []
        for p, (_, ids) in enumerate(prompts):
            check_prompt(state, ids, max_tokens, "messages" if chat else "prompt")
            for i in range(body.n):
                seed = None if body.seed is None else body.seed + i
                params = sampling_params(body, max_tokens, logprobs, seed, spec, state.default_sampling_params)
                rid = f"{self.id}-{p}-{i}"
                self.choices.append(Choice(len(self.choices), rid, state.tokenizer, params))
                children.append((rid, ids, params))
        self.outputs = {c.request_id: make_output() for c in self.choices} if make_output else {}
        self.by_id = {c.request_id: c for c in self.choices}
        timers = [t for _, ids in prompts for t in state.metrics.start_request(len(ids), max_tokens, body.n)]
        self.timers = {c.request_id: t for c, t in zip(self.choices, timers)}
        try:
            self.handle = state.client.submit(children, body.priority, body.cache_salt)
        except EngineDead as exc:
            raise APIError(503, f"the engine is not available: {exc}") from None
        self._deltas = self.handle.deltas()
        self._first = None
        self.refused: str | None = None  # admission control refused one of the samples

    async def start(self) -> None:
        """Wait for the first delta before answering, so a request the engine refuses (an
        invalid grammar) still gets a 4xx instead of a broken stream."""
        try:
            self._first = await anext(self._deltas)
        except StopAsyncIteration:
            return
        except EngineDead as exc:
            self.handle.close()
            raise APIError(500, f"the engine core died: {exc}", code="engine_dead") from None
        if self._first.finish_reason == "error":
            self.handle.close()
            if self._first.error_code == "overloaded":
                raise overloaded(self._first.error)
            raise bad_request(self._first.error or "the engine rejected this request")

    async def deltas(self):
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        async for delta in self._deltas:
            yield delta

    def feed(self, delta) -> tuple[Choice, str, list]:
        if delta.error_code == "overloaded":
            self.refused = delta.error  # one sample refused: the whole response is a 503 / an error frame
        choice = self.by_id[delta.request_id]
        timer = self.timers[delta.request_id]
        timer.tokens(len(delta.token_ids), delta.timing)
        text, entries = choice.feed(delta)
        if choice.hit_stop_string and delta.finish_reason is None:
            self.handle.abort([choice.request_id])  # the engine does not know about stop strings
        if choice.finish_reason is not None:
            timer.finished(choice.finish_reason)
        return choice, text, entries

    def usage(self) -> dict:
        prompt = sum(len(ids) for _, ids in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _logprobs(self, choice: Choice, entries: list, text_offset: int = 0):
        if self.chat:
            return choice.chat_logprobs(entries) if self.body.logprobs else None
        return choice.completion_logprobs(entries, text_offset) if self.body.logprobs is not None else None

    def _echo(self, choice: Choice) -> str:
        prompt_text = self.prompts[choice.index // self.body.n][0]
        if prompt_text is None:
            prompt_text = self.state.tokenizer.decode(self.prompts[choice.index // self.body.n][1])
        return prompt_text

    # -- one response ------------------------------------------------------------------
    async def collect(self, request: Request) -> JSONResponse:
        async def pump():
            async for delta in self.deltas():
                self.feed(delta)
                if self.refused is not None:  # the others are aborted by close() below
                    return

        task = asyncio.create_task(pump())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    return JSONResponse({}, status_code=499)
            task.result()
        except EngineDead as exc:
            raise APIError(500, f"the engine core died: {exc}", code="engine_dead") from None
        finally:
            self.handle.close()
        if self.refused is not None:
            raise overloaded(self.refused)
        errors = [c for c in self.choices if c.finish_reason == "error"]
        if errors:
            raise bad_request(str(errors[0].stop_reason))
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                             "created": self.created, "model": self.state.model_name,
                             "choices": [self._choice_body(c) for c in self.choices], "usage": self.usage()})

    def _choice_body(self, c: Choice) -> dict:
        stop_reason = c.stop_reason if c.finish_reason == "stop" else None
        if self.chat:
            output = self.outputs[c.request_id]
            return {"index": c.index, "message": output.message(c.text),
                    "logprobs": self._logprobs(c, c.logprobs), "finish_reason": output.finish_reason(c.finish_reason),
                    "stop_reason": stop_reason}
        prefix = self._echo(c) if self.body.echo else ""
        return {"index": c.index, "text": prefix + c.text, "logprobs": self._logprobs(c, c.logprobs, len(prefix)),
                "finish_reason": c.finish_reason, "stop_reason": stop_reason}

    # -- a stream ----------------------------------------------------------------------
    def stream(self) -> StreamingResponse:
        return StreamingResponse(self._frames(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def _chunks(self, choice: Choice, text: str, entries: list, first: bool = False) -> list[str]:
        """SSE frames for one step of one choice; the last carries its finish_reason."""
        if self.chat:
            output = self.outputs[choice.request_id]
            if first:
                deltas = [{"role": "assistant", "content": ""}]
            else:
                deltas = (output.on_text(text) if text else []) + (output.on_finish() if choice.finish_reason else [])
            deltas = deltas or [{}]
            logprobs = self._logprobs(choice, entries) if entries else None
            finish = None if first else output.finish_reason(choice.finish_reason)
            bodies = [{"index": choice.index, "delta": d, "logprobs": logprobs if i == 0 else None,
                       "finish_reason": finish if i == len(deltas) - 1 else None} for i, d in enumerate(deltas)]
        else:
            offset = choice.emitted - len(text) + (len(self._echo(choice)) if self.body.echo else 0)
            bodies = [{"index": choice.index, "text": text, "finish_reason": choice.finish_reason,
                       "logprobs": self._logprobs(choice, entries, offset) if entries else None}]
        if choice.finish_reason == "stop" and not first:
            bodies[-1]["stop_reason"] = choice.stop_reason
        return [self._frame({"choices": [body]}) for body in bodies]

    def _frame(self, payload: dict) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return "data: " + json.dumps({"id": self.id, "object": kind, "created": self.created,
                                      "model": self.state.model_name, **payload}) + "\n\n"

    async def _frames(self):
        try:
            for choice in self.choices:
                if self.chat:
                    yield self._chunks(choice, "", [], first=True)[0]
                elif self.body.echo:
                    yield self._chunks(choice, self._echo(choice), [])[0]
            async for delta in self.deltas():
                choice, text, entries = self.feed(delta)
                if self.refused is not None:
                    yield "data: " + json.dumps(overloaded(self.refused).body()) + "\n\n"
                    break
                if text or entries or choice.finish_reason:
                    for frame in self._chunks(choice, text, entries):
                        yield frame
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield self._frame({"choices": [], "usage": self.usage()})
        except EngineDead as exc:
            error = APIError(500, f"the engine core died: {exc}", code="engine_dead")
            yield "data: " + json.dumps(error.body()) + "\n\n"
        finally:
            self.handle.close()
        yield "data: [DONE]\n\n"


async def completions(request: Request):
    state = request.app.state.server
    body: CompletionRequest = await read_body(request, CompletionRequest, state.max_body_bytes)
    check_model(state, body.model)
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {body.logprobs}", "logprobs")
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    prompts = completion_prompts(state.tokenizer, body.prompt)
    generation = Generation(state, body, prompts, max_tokens, body.logprobs, chat=False,
                            spec=structured_spec(body, chat=False))
    await generation.start()
    return generation.stream() if body.stream else await generation.collect(request)


async def chat_completions(request: Request):
    state = request.app.state.server
    body: ChatCompletionRequest = await read_body(request, ChatCompletionRequest, state.max_body_bytes)
    check_model(state, body.model)
    if body.top_logprobs is not None:
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}", "top_logprobs")
        if not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    mode, tools = check_tools(body.tools, body.tool_choice)
    spec = structured_spec(body, chat=True)
    forced = tool_grammar(mode, tools, body.parallel_tool_calls)
    if forced is not None and spec is not None:
        raise bad_request("tool_choice=required or a named tool cannot be combined with another "
                          "structured-output constraint", "tool_choice")
    parser_cls = state.tool_parser if mode == "auto" else None
    tool_list = list(body.tools or []) if mode != "none" else None
    tool_prompt = state.tool_parser(state.tokenizer).system_prompt(tool_list) if tool_list else None
    ids = chat_prompt(state.tokenizer, body.messages, body.add_generation_prompt, tool_list, tool_prompt)
    if max_tokens is None:
        max_tokens = default_max_tokens(state, len(ids))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None

    def make_output() -> ChatOutput:
        return ChatOutput(mode, parser_cls(state.tokenizer) if parser_cls else None, body.parallel_tool_calls)

    generation = Generation(state, body, [(None, ids)], max_tokens, logprobs, chat=True, spec=forced or spec,
                            make_output=make_output)
    await generation.start()
    return generation.stream() if body.stream else await generation.collect(request)
