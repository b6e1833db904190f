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

from engine.sampling_params import InvalidParam, SamplingParams
from engine_server.choices import Choice
from engine_server.client import EngineDead
from engine_server.errors import APIError, bad_request
from engine_server.schemas import ChatCompletionRequest, CompletionRequest

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


def chat_prompt(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
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
        conversation.append({"role": "system" if message.role == "developer" else message.role,
                             "content": content or ""})
    if not tokenizer.chat_template:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                            tokenize=True)
    except Exception as exc:  # template errors (roles out of order ...) are the caller's
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def sampling_params(body, max_tokens: int | None, logprobs: int | None, seed: int | None) -> SamplingParams:
    def given(value, default):
        return default if value is None else value

    try:
        return SamplingParams(
            temperature=given(body.temperature, 1.0), top_p=given(body.top_p, 1.0), top_k=given(body.top_k, 0),
            min_p=given(body.min_p, 0.0), frequency_penalty=given(body.frequency_penalty, 0.0),
            presence_penalty=given(body.presence_penalty, 0.0),
            repetition_penalty=given(body.repetition_penalty, 1.0), seed=seed, max_tokens=max_tokens,
            min_tokens=body.min_tokens, stop=body.stop or (), stop_token_ids=body.stop_token_ids or (),
            include_stop_str_in_output=body.include_stop_str_in_output, ignore_eos=body.ignore_eos,
            logprobs=logprobs, skip_special_tokens=body.skip_special_tokens)
    except InvalidParam as exc:
        raise bad_request(str(exc), exc.param) from None


class Generation:
    """One HTTP request's fan-out: a choice per (prompt, sample) and their engine requests."""

    def __init__(self, state, body, prompts, max_tokens, logprobs, chat: bool):
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
                params = sampling_params(body, max_tokens, logprobs, seed)
                rid = f"{self.id}-{p}-{i}"
                self.choices.append(Choice(len(self.choices), rid, state.tokenizer, params))
                children.append((rid, ids, params))
        self.by_id = {c.request_id: c for c in self.choices}
        self.timers = {c.request_id: state.metrics.request_timer(len(ids)) for c, (_, ids, _) in
                       zip(self.choices, children)}
        try:
            self.handle = state.client.submit(children, body.priority, body.cache_salt)
        except EngineDead as exc:
            raise APIError(503, f"the engine is not available: {exc}") from None

    def feed(self, delta) -> tuple[Choice, str, list]:
        choice = self.by_id[delta.request_id]
        timer = self.timers[delta.request_id]
        timer.tokens(len(delta.token_ids))
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
            async for delta in self.handle.deltas():
                self.feed(delta)

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
        errors = [c for c in self.choices if c.finish_reason == "error"]
        if errors:
            raise bad_request(str(errors[0].stop_reason))
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                             "created": self.created, "model": self.state.model_name,
                             "choices": [self._choice_body(c) for c in self.choices], "usage": self.usage()})

    def _choice_body(self, c: Choice) -> dict:
        stop_reason = c.stop_reason if c.finish_reason == "stop" else None
        if self.chat:
            return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c, c.logprobs), "finish_reason": c.finish_reason,
                    "stop_reason": stop_reason}
        prefix = self._echo(c) if self.body.echo else ""
        return {"index": c.index, "text": prefix + c.text, "logprobs": self._logprobs(c, c.logprobs, len(prefix)),
                "finish_reason": c.finish_reason, "stop_reason": stop_reason}

    # -- a stream ----------------------------------------------------------------------
    def stream(self) -> StreamingResponse:
        return StreamingResponse(self._frames(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def _chunk(self, choice: Choice, text: str, entries: list, first: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            body = {"index": choice.index, "delta": delta, "logprobs": self._logprobs(choice, entries) if entries else None,
                    "finish_reason": choice.finish_reason}
        else:
            body = {"index": choice.index, "text": text, "finish_reason": choice.finish_reason,
                    "logprobs": self._logprobs(choice, entries, 0) if entries else None}
        if choice.finish_reason == "stop":
            body["stop_reason"] = choice.stop_reason
        return self._frame({"choices": [body]})

    def _frame(self, payload: dict) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return "data: " + json.dumps({"id": self.id, "object": kind, "created": self.created,
                                      "model": self.state.model_name, **payload}) + "\n\n"

    async def _frames(self):
        try:
            for choice in self.choices:
                if self.chat:
                    yield self._chunk(choice, "", [], first=True)
                elif self.body.echo:
                    yield self._chunk(choice, self._echo(choice), [])
            async for delta in self.handle.deltas():
                choice, text, entries = self.feed(delta)
                if text or entries or choice.finish_reason:
                    yield self._chunk(choice, text, entries)
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
    generation = Generation(state, body, prompts, max_tokens, body.logprobs, chat=False)
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
    ids = chat_prompt(state.tokenizer, body.messages, body.add_generation_prompt)
    if max_tokens is None:
        max_tokens = max(1, state.max_model_len - len(ids))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    generation = Generation(state, body, [(None, ids)], max_tokens, logprobs, chat=True)
    return generation.stream() if body.stream else await generation.collect(request)
