"""`/v1/completions` and `/v1/chat/completions`: read the body, validate and tokenize it off
the event loop, fan out one engine request per prompt and sample, then stream SSE chunks (with
blank-line keep-alives while no token comes) or collect one response. Every way out of a request
(an error, a 500, a client that leaves while queued, in prefill or in decode) aborts its
unfinished engine requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

import attrs
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine.client import EngineDead, OutputProcessor, SequenceOutput
from engine.entrypoints.harmony import stop_token_ids
from engine.interfaces import GrammarSpec
from engine.kv_transfer import check_kv_transfer_params
from engine.lora import LoRARequest
from engine.messages.multimodal import MultiModalItem
from engine.messages.sampling_params import InvalidParam, SamplingParams, tokenize_bad_words, truncate_prompt
from engine_server.bounds import check_budget, json_response, salted, too_large
from engine_server.errors import (
    APIError,
    bad_request,
    engine_dead,
    engine_unavailable,
    internal_error,
    overloaded,
)
from engine_server.harmony import render_chat
from engine_server.keepalive import KEEPALIVE_FRAME, QUIET
from engine_server.logprobs import LogprobFormat
from engine_server.lora import UnknownModel
from engine_server.prompts import chat_prompt, check_fanout, check_prompt, completion_prompts
from engine_server.schemas import INT64_MAX, ChatCompletionRequest, CompletionRequest
from engine_server.structured import structured_spec
from engine_server.timings import request_timings
from engine_server.tools import ChatOutput, check_tools, tool_grammar
from engine_server.validation import ClientGone, decode_body

logger = logging.getLogger("engine_server")


def check_model(state, name: str | None) -> LoRARequest | None:
    """The LoRA adapter a request's ``model`` names (None: the base model); a 404 for a name the
    server does not serve (:class:`UnknownModel`)."""
    if name is None or name == state.model_name:
        return None
    lora = state.lora.get(name) if state.lora is not None else None
    if lora is None:
        raise UnknownModel(name)
    return lora


def check_runner(state, wanted: str) -> None:
    """A 400 when the route needs the other runner: embeddings, scores or classifications on a
    server that generates, completions on one that pools."""
    if state.runner == wanted:
        return
    if wanted == "pooling":
        raise bad_request(
            "this server generates text and has no pooling model; start one with `engine serve "
            "MODEL --runner pooling` for /v1/embeddings, /score, /rerank and /classify",
            "model",
        )
    raise bad_request(
        "this server runs an embedding model or classifier (--runner pooling) and generates nothing; "
        "use /v1/embeddings, /score, /rerank or /classify",
        "model",
    )


def check_sampling(state, body) -> None:
    """What depends on ``n``: the per-sample seeds ``seed + i`` within 64 bits (token ids
    against the vocabulary are checked by :meth:`SamplingParams.check_vocab`)."""
    if body.seed is not None and body.seed + body.n - 1 > INT64_MAX:
        raise bad_request(f"seed + n - 1 must not exceed {INT64_MAX} (sample i uses seed + i)", "seed")


def check_kv_transfer(body, num_prompts: int) -> None:
    """``kv_transfer_params`` (P/D) are well formed and go with one sequence: one prompt, n=1."""
    if body.kv_transfer_params is None:
        return
    problem = check_kv_transfer_params(body.kv_transfer_params)
    if problem:
        raise bad_request(problem, "kv_transfer_params")
    if num_prompts != 1 or body.n != 1:
        raise bad_request("kv_transfer_params: a P/D request has one prompt and n=1", "kv_transfer_params")


def logit_bias(body) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` keys are token ids written as strings."""
    if not body.logit_bias:
        return None
    bias = {}
    for token, value in body.logit_bias.items():
        try:
            bias[int(token)] = value
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids, got {token[:40]!r}", "logit_bias"
            ) from None
    return bias


def truncated(state, ids: list[int], body) -> list[int]:
    """The prompt under ``truncate_prompt_tokens`` (the last k tokens), as the core's
    :func:`truncate_prompt` cuts it for ``LLM``."""
    try:
        return truncate_prompt(ids, body.truncate_prompt_tokens, state.max_model_len)
    except InvalidParam as exc:
        raise bad_request(str(exc), exc.param) from None


def prompt_logprobs(body, chat: bool) -> int | None:
    """Top-n of the prompt's log-probs the engine computes: ``prompt_logprobs``, and on
    ``/v1/completions`` ``echo`` with ``logprobs`` (the prompt's own log-probs, as vLLM
    returns them: what lm-eval's loglikelihood requests read)."""
    wanted = [
        n for n in (body.prompt_logprobs, None if chat or not body.echo else body.logprobs) if n is not None
    ]
    return max(wanted) if wanted else None


def default_max_tokens(state, num_prompt_tokens: int) -> int:
    """max_tokens of a chat request that sets none: what the context leaves, or less when
    the generation config sets ``max_new_tokens``."""
    room = max(1, state.max_model_len - num_prompt_tokens)
    return min(room, state.default_sampling_params.get("max_tokens", room))


def sampling_params(
    state,
    body,
    max_tokens: int | None,
    logprobs: int | None,
    spec: GrammarSpec | None = None,
    chat: bool = False,
) -> SamplingParams:
    """The parameters of the request's first sample (sample ``i`` is seeded ``seed + i``):
    the model's generation config fills the sampling fields a request leaves out;
    ``bad_words`` are tokenized here and every token id is checked against the vocabulary."""
    defaults = state.default_sampling_params or {}

    def given(value, default):
        return default if value is None else value

    try:
        params = SamplingParams(
            temperature=given(body.temperature, defaults.get("temperature", 1.0)),
            top_p=given(body.top_p, defaults.get("top_p", 1.0)),
            top_k=given(body.top_k, defaults.get("top_k", 0)),
            min_p=given(body.min_p, defaults.get("min_p", 0.0)),
            frequency_penalty=given(body.frequency_penalty, 0.0),
            presence_penalty=given(body.presence_penalty, 0.0),
            repetition_penalty=given(body.repetition_penalty, defaults.get("repetition_penalty", 1.0)),
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=body.stop or (),
            stop_token_ids=body.stop_token_ids or (),
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs(body, chat),
            skip_special_tokens=body.skip_special_tokens,
            logit_bias=logit_bias(body),
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words or (),
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            structured_outputs=spec,
        )
        params = tokenize_bad_words(params, state.tokenizer)
        params.check_vocab(state.vocab_size)
    except InvalidParam as exc:
        raise bad_request(str(exc), exc.param) from None
    return params


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read, so ``receive`` only waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, coroutine):
    """The coroutine's result, or :class:`ClientGone` (the coroutine cancelled) if the
    client disconnects first."""
    task = asyncio.ensure_future(coroutine)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait({task})  # let it unwind; its CancelledError stays with it
        raise ClientGone()
    return task.result()


class EngineStream(StreamingResponse):
    """An SSE response that aborts its engine requests however it ends (``close``), even when
    the client leaves before the first frame is produced."""

    def __init__(self, frames, close):
        super().__init__(frames, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.close = close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.close()


class Generation:
    """One HTTP request's fan-out: a choice per (prompt, sample) and their engine requests.
    Built (validated, sampling parameters made) off the event loop; :meth:`run` submits."""

    def __init__(
        self,
        state,
        body,
        prompts,
        max_tokens,
        logprobs,
        chat: bool,
        spec: GrammarSpec | None = None,
        make_output=None,
        lora: LoRARequest | None = None,
        mm_items: tuple[MultiModalItem, ...] = (),
    ):
        """``lora``: the adapter every sample runs with (None: the base model); ``mm_items``:
        the images of the one prompt (a chat's)."""
        check_sampling(state, body)
        check_kv_transfer(body, len(prompts))
        self.state, self.body, self.prompts, self.chat = state, body, prompts, chat
        self.lora, self.mm_items = lora, mm_items
        self.lora_name = None if lora is None else lora.lora_name
        self.model_name = self.lora_name or state.model_name
        self.id = self._new_id()
        self.created = int(time.time())
        self.processor = OutputProcessor(state.tokenizer)
        self.choices: list[SequenceOutput] = []
        self.children = []
        first = attrs.evolve(sampling_params(state, body, max_tokens, logprobs, spec, chat), n=body.n)
        tokens_as_ids = (
            state.return_tokens_as_token_ids
            if body.return_tokens_as_token_ids is None
            else body.return_tokens_as_token_ids
        )
        self.format = LogprobFormat(state.tokenizer, tokens_as_ids)
        self._check_budget(max_tokens, logprobs, first.prompt_logprobs)
        image_tokens = sum(item.length for item in mm_items)
        for p, (text, ids) in enumerate(prompts):
            check_prompt(state, ids, max_tokens, "messages" if chat else "prompt", image_tokens=image_tokens)
            request, children = self.processor.add(f"{self.id}-{p}", text, ids, first, len(self.choices))
            self.choices += request.sequences
            self.children += children
        self.outputs = {c.request_id: make_output() for c in self.choices} if make_output else {}
        self.max_tokens = max_tokens
        self.timers = {}
        self.handle = None
        self._first = None
        self._answered = None  # the engine's first delta, once one came
        self.refused: str | None = None  # admission control refused one of the samples
        self.cache_salt = body.cache_salt  # under the API key's salt: see :func:`bounds.salted`
        self._echoed: dict[str, dict] = {}  # request id -> its echoed prompt's log-probs
        self.trace = None  # a RequestTrace with --otlp-traces-endpoint

    def _new_id(self) -> str:
        """The response's ``id``; a subclass answering in another API's shape names its own."""
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _check_budget(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> None:
        """``--max-request-budget``, charged at the most alternatives any position asks for."""
        top_n = max(logprobs or 0, prompt_logprobs or 0)
        param = "max_tokens"
        if top_n:
            param = "prompt_logprobs" if top_n == (prompt_logprobs or 0) else self._logprobs_param
        lengths = [len(ids) for _, ids in self.prompts]
        check_budget(self.state, self.body.n, lengths, max_tokens, top_n, param)

    @property
    def _logprobs_param(self) -> str:
        return "top_logprobs" if self.chat else "logprobs"

    async def run(self, request: Request) -> Response:
        """Submit, wait for the engine's first answer (so a request it refuses, such as an
        invalid grammar, still gets a 4xx), then answer. A stream waits for it one keep-alive
        interval at most, then starts without it. We close on every way out here, except a
        stream handed to starlette, which closes when it ends."""
        self._submit()
        streaming = False
        try:
            await unless_disconnected(request, self._start())
            if self.body.stream:
                streaming = True
                return EngineStream(self._frames(), self.close)
            return await self._collect(request)
        finally:
            if not streaming:
                self.close()

    def close(self) -> None:
        """Abort the engine requests still open and release the request's timers."""
        self.handle.close()
        for timer in self.timers.values():
            timer.released()
        if self.trace is not None:
            self.trace.finished(self)

    def _submit(self) -> None:
        if self.state.log_requests:
            self._log()
        submitted = time.monotonic()  # the timers start here: TTFT includes the hand-over to the core
        try:
            self.handle = self.state.client.submit(
                self.children,
                self.body.priority,
                self.cache_salt,
                self.body.kv_transfer_params,
                self.lora,
                self.mm_items,
            )
        except EngineDead:
            raise engine_unavailable() from None
        except Exception:
            self.state.client.abort([rid for rid, _, _ in self.children])  # those sent before the failure
            raise
        if self.trace is not None:
            self.trace.submitted = submitted
        metrics = self.state.metrics
        timers = [
            t
            for _, ids in self.prompts
            for t in metrics.start_request(len(ids), self.max_tokens, self.body.n, self.lora_name, submitted)
        ]
        self.timers = {c.request_id: t for c, t in zip(self.choices, timers)}
        interval = self.state.keepalive_interval if self.body.stream else None
        self._deltas = self.handle.deltas(quiet_after=interval)  # QUIET only in a stream, to send keep-alives

    def _log(self) -> None:
        """``--enable-log-requests``: each engine request's prompt (cut to ``--max-log-len``)
        and parameters."""
        limit = self.state.max_log_len
        for (rid, ids, params), (text, _) in zip(
            self.children, [p for p in self.prompts for _ in range(self.body.n)]
        ):
            prompt = (text if text is not None else ids)[:limit]
            logger.info("request %s: prompt %r, %d prompt tokens, %s", rid, prompt, len(ids), params)

    def _engine_dead(self, exc: EngineDead) -> APIError:
        """500 engine_dead for a core death, 503 shutdown for a drain cut short: the request
        id only, the details in the log."""
        logger.error("request %s: %s", self.id, exc)
        return engine_dead(exc, self.id)

    async def _start(self) -> None:
        try:
            first = await anext(self._deltas)
        except StopAsyncIteration:
            return
        except EngineDead as exc:
            raise self._engine_dead(exc) from None
        if first is QUIET:  # a stream that waited a keep-alive interval: it starts without it
            return
        self._first = self._answered = first
        refusal = self._refusal(first)
        if refusal is not None:
            raise refusal

    @staticmethod
    def _refusal(first) -> APIError | None:
        """The error for an engine that refused the request in its first answer, or None."""
        if first.finish_reason != "error":
            return None
        if first.error_code == "overloaded":
            return overloaded(first.error)
        return bad_request(first.error or "the engine rejected this request")

    async def deltas(self):
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        async for delta in self._deltas:
            yield delta

    def feed(self, delta) -> tuple[SequenceOutput, str, list]:
        if delta.error_code == "overloaded":
            self.refused = delta.error  # one sample refused: the whole response is a 503 / an error frame
        timer = self.timers[delta.request_id]
        timer.tokens(len(delta.token_ids), delta.timing)
        if self.trace is None:
            choice, text, entries = self.processor.feed(delta)
        else:
            self.trace.token_delta(delta.request_id, len(delta.token_ids))
            began = time.monotonic()
            choice, text, entries = self.processor.feed(delta)
            self.trace.detokenize += time.monotonic() - began
        aborts = self.processor.take_aborts()  # a stop string: the engine does not know them
        if aborts:
            self.handle.abort(aborts)
        if choice.finish_reason is not None:
            timer.finished(choice.finish_reason)
        return choice, text, entries

    def usage(self) -> dict:
        """Token counts; with ``--enable-prompt-tokens-details`` also the prompt tokens the
        prefix cache held (each prompt counted once, by its first sample, as its tokens are)."""
        prompt = sum(len(ids) for _, ids in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self.state.enable_prompt_tokens_details:
            cached = sum(c.num_cached_tokens for c in self.choices[:: self.body.n])
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def _logprobs(self, entries: list, text_offset: int = 0):
        if self.chat:
            return self.format.chat_logprobs(entries) if self.body.logprobs else None
        if self.body.logprobs is None:
            return None
        return self.format.completion_logprobs(entries, text_offset)

    def _echo(self, choice: SequenceOutput) -> str:
        request = choice.request
        if request.prompt is not None:
            return request.prompt
        return self.state.tokenizer.decode(request.prompt_token_ids)

    # -- one response ------------------------------------------------------------------
    async def _collect(self, request: Request) -> Response:
        async def pump():
            async for delta in self.deltas():
                self.feed(delta)
                if self.refused is not None:  # the others are aborted by close() below
                    return

        try:
            await unless_disconnected(request, pump())
        except EngineDead as exc:
            raise self._engine_dead(exc) from None
        if self.refused is not None:
            raise overloaded(self.refused)
        errors = [c for c in self.choices if c.finish_reason == "error"]
        if errors:
            raise bad_request(str(errors[0].stop_reason))
        return await json_response(self.state, self._response, self._entries())

    def _entries(self) -> int:
        """About how many tokens and log-probs the response holds (what its size scales with)."""
        top_n = (self._top_n or 0) + 1
        tokens = sum(len(c.token_ids) for c in self.choices) * top_n
        prompt = sum(len(ids) for _, ids in self.prompts)
        if self.body.prompt_logprobs is not None:
            tokens += prompt * (self.body.prompt_logprobs + 1)
        if not self.chat and self.body.echo:
            tokens += prompt * self.body.n * top_n
        return tokens

    @property
    def _top_n(self) -> int | None:
        """Alternatives per generated token (None: no log-probs)."""
        if self.chat:
            return (self.body.top_logprobs or 0) if self.body.logprobs else None
        return self.body.logprobs

    def _response(self) -> dict:
        """The whole response (on a worker thread when large: see :func:`bounds.json_response`)."""
        response = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": [self._choice_body(c) for c in self.choices],
            "usage": self.usage(),
        }
        if self.chat and self.body.prompt_logprobs is not None:  # per response, as vLLM's chat route
            response["prompt_logprobs"] = self.format.prompt_logprobs(self.choices[0].request)
        if (
            self.body.kv_transfer_params is not None
        ):  # P/D: where a decode instance finds the blocks (or null)
            response["kv_transfer_params"] = self.choices[0].kv_transfer_params
        if self._timings_wanted:
            response["timings"] = request_timings(self)
        return response

    @property
    def _timings_wanted(self) -> bool:
        return self.state.request_timings if self.body.timings is None else self.body.timings

    def _choice_body(self, c: SequenceOutput) -> dict:
        stop_reason = c.stop_reason if c.finish_reason == "stop" else None
        if self.chat:
            output = self.outputs[c.request_id]
            return {
                "index": c.index,
                "message": output.message(c.text),
                "logprobs": self._logprobs(c.logprobs),
                "finish_reason": output.finish_reason(c.finish_reason),
                "stop_reason": stop_reason,
            }
        prefix = self._echo(c) if self.body.echo else ""
        logprobs = self._logprobs(c.logprobs, len(prefix))
        if prefix and logprobs is not None:
            echoed = self._echo_logprobs(c)
            logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
        body = {
            "index": c.index,
            "text": prefix + c.text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": stop_reason,
        }
        if self.body.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(c)
        return body

    def _prompt_logprobs(self, c: SequenceOutput) -> list | None:
        """A prompt's log-probs in its first sample's choice only (null in the others): they
        are the same for every sample, and vLLM's copy in each of the ``n`` choices made a
        12 KB request answer 87 MB."""
        return self.format.prompt_logprobs(c.request) if c is c.request.sequences[0] else None

    def _echo_logprobs(self, c: SequenceOutput) -> dict:
        """The echoed prompt's log-probs, formatted once per prompt for its ``n`` choices."""
        rid = c.request.request_id
        if rid not in self._echoed:
            self._echoed[rid] = self.format.echo_logprobs(c.request)
        return self._echoed[rid]

    # -- a stream ----------------------------------------------------------------------
    def _chunks(self, choice: SequenceOutput, text: str, entries: list, first: bool = False) -> list[str]:
        """SSE frames for one step of one choice; the last carries its finish_reason."""
        if self.chat:
            output = self.outputs[choice.request_id]
            if first:
                deltas = [{"role": "assistant", "content": ""}]
            else:
                deltas = (output.on_text(text) if text else []) + (
                    output.on_finish() if choice.finish_reason else []
                )
            deltas = deltas or [{}]
            logprobs = self._logprobs(entries) if entries else None
            finish = None if first else output.finish_reason(choice.finish_reason)
            bodies = [
                {
                    "index": choice.index,
                    "delta": d,
                    "logprobs": logprobs if i == 0 else None,
                    "finish_reason": finish if i == len(deltas) - 1 else None,
                }
                for i, d in enumerate(deltas)
            ]
        else:
            offset = choice.emitted - len(text) + (len(self._echo(choice)) if self.body.echo else 0)
            bodies = [
                {
                    "index": choice.index,
                    "text": text,
                    "finish_reason": choice.finish_reason,
                    "logprobs": self._logprobs(entries, offset) if entries else None,
                }
            ]
        if choice.finish_reason == "stop" and not first:
            bodies[-1]["stop_reason"] = choice.stop_reason
        return [self._frame({"choices": [body]}) for body in bodies]

    def _frame(self, payload: dict) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return (
            "data: "
            + json.dumps(
                {
                    "id": self.id,
                    "object": kind,
                    "created": self.created,
                    "model": self.model_name,
                    **payload,
                }
            )
            + "\n\n"
        )

    # what a stream sends while no token comes, and after its last frame (None: nothing)
    keepalive_frame = KEEPALIVE_FRAME
    done_frame: str | None = "data: [DONE]\n\n"

    def _error_frame(self, error: APIError) -> str:
        return "data: " + json.dumps(error.body()) + "\n\n"

    def _opening_frames(self) -> list[str]:
        """What a stream sends before the first token: each chat choice's role."""
        return [self._chunks(choice, "", [], first=True)[0] for choice in self.choices] if self.chat else []

    def _closing_frames(self, failed: bool) -> list[str]:
        """What a stream sends after the last token (``failed``: after an error frame)."""
        usage = self.body.stream_options is not None and self.body.stream_options.include_usage
        if not (usage or self._timings_wanted):
            return []
        return [
            self._frame(
                {
                    "choices": [],
                    **({"usage": self.usage()} if usage else {}),
                    **({"timings": request_timings(self)} if self._timings_wanted else {}),
                }
            )
        ]

    async def _frames(self):
        """The SSE frames, ended with an error frame (code ``response_too_large``) once they
        pass ``--max-response-bytes`` in all; the stream's end then aborts the samples."""
        sent, limit = 0, self.state.max_response_bytes
        async with contextlib.aclosing(self._stream_frames()) as frames:
            async for frame in frames:
                sent += len(frame.encode())
                if limit and sent > limit:
                    yield self._error_frame(too_large(sent, limit))
                    if self.done_frame:
                        yield self.done_frame
                    return
                yield frame

    async def _stream_steps(self):
        """A stream's engine deltas, fed: :data:`QUIET` when a keep-alive is due, else
        ``(choice, text, entries)``; a refusal (the engine's first answer, or admission control
        refusing one sample) comes as the :class:`APIError` that ends the stream."""
        async for delta in self.deltas():
            if delta is QUIET:
                yield delta
                continue
            if self._answered is None:  # the first answer came after the stream started
                self._answered = delta
                refusal = self._refusal(delta)
                if refusal is not None:
                    yield refusal
                    return
            step = self.feed(delta)
            if self.refused is not None:
                yield overloaded(self.refused)
                return
            yield step

    async def _stream_frames(self):
        failed = False
        try:
            for frame in self._opening_frames():
                yield frame
            # echo with logprobs waits for the prompt's log-probs, all in before the first token
            unechoed = {c.request_id for c in self.choices} if not self.chat and self.body.echo else set()
            for choice in self.choices:
                if not self.chat and self.body.echo and self.body.logprobs is None:
                    unechoed.discard(choice.request_id)
                    yield self._chunks(choice, self._echo(choice), [])[0]
            async for step in self._stream_steps():
                if step is QUIET:
                    yield self.keepalive_frame
                    continue
                if isinstance(step, APIError):
                    failed = True
                    yield self._error_frame(step)
                    break
                choice, text, entries = step
                if choice.request_id in unechoed and (choice.token_ids or choice.finish_reason):
                    unechoed.discard(choice.request_id)
                    yield self._frame(
                        {
                            "choices": [
                                {
                                    "index": choice.index,
                                    "text": self._echo(choice),
                                    "logprobs": self.format.echo_logprobs(choice.request),
                                    "finish_reason": None,
                                }
                            ]
                        }
                    )
                if text or entries or choice.finish_reason:
                    for frame in self._chunks(choice, text, entries):
                        yield frame
            for frame in self._closing_frames(failed):
                yield frame
        except EngineDead as exc:
            yield self._error_frame(self._engine_dead(exc))
        except Exception:
            logger.exception("request %s: internal error while streaming", self.id)
            yield self._error_frame(internal_error(self.id))
        if self.done_frame:
            yield self.done_frame


def prepare_completion(state, data: bytes) -> Generation:
    """Everything up to submitting, for the worker thread: decode, validate, tokenize."""
    body: CompletionRequest = decode_body(data, CompletionRequest, state.allow_unknown_fields)
    lora = check_model(state, body.model)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    spec = structured_spec(body, chat=False)
    prompts = [
        (text, ids) if len(cut := truncated(state, ids, body)) == len(ids) else (None, cut)
        for text, ids in completion_prompts(state, body.prompt, body.n)
    ]  # an echo shows what was read
    return Generation(state, body, prompts, max_tokens, body.logprobs, chat=False, spec=spec, lora=lora)


def prepare_chat(state, data: bytes) -> Generation:
    """Everything up to submitting, for the worker thread: decode, validate, template."""
    body: ChatCompletionRequest = decode_body(data, ChatCompletionRequest, state.allow_unknown_fields)
    if body.store and not state.allow_unknown_fields:  # that flag ignores what is not implemented
        raise bad_request("stored chat completions are not supported: leave store false", "store")
    return chat_generation(state, body, lora=check_model(state, body.model))


def chat_prompt_ids(
    state, body: ChatCompletionRequest, mode: str
) -> tuple[list[int], tuple[MultiModalItem, ...]]:
    """The conversation's token ids as the model reads them, and its images' items: the tools
    (in the template, or as the tool parser's instructions), the chat template, the images'
    placeholders widened, ``truncate_prompt_tokens`` (which may not cut a prompt with images)."""
    tool_list = list(body.tools or []) if mode != "none" else None
    if state.harmony:
        return harmony_prompt(state, body, tool_list), ()
    tool_prompt = state.tool_parser(state.tokenizer).system_prompt(tool_list) if tool_list else None
    ids, items = chat_prompt(
        state.tokenizer,
        body.messages,
        body.add_generation_prompt,
        tool_list,
        tool_prompt,
        body.continue_final_message,
        body.chat_template_kwargs,
        state.images,
    )
    cut = truncated(state, ids, body)
    if items and len(cut) < len(ids):
        raise bad_request(
            "truncate_prompt_tokens would cut a prompt with images (their placeholders must stay whole)",
            "truncate_prompt_tokens",
        )
    return cut, items


def harmony_prompt(state, body: ChatCompletionRequest, tools: list[dict] | None) -> list[int]:
    """A gpt-oss conversation in harmony, ending with the assistant's turn opened."""
    if body.continue_final_message or not body.add_generation_prompt:
        field = "continue_final_message" if body.continue_final_message else "add_generation_prompt"
        raise bad_request(f"{field}: a harmony prompt always ends by opening the assistant's turn", field)
    messages = [msgspec.structs.asdict(m) for m in body.messages]
    return truncated(state, render_chat(messages, tools, body.chat_template_kwargs), body)


def chat_generation(
    state, body: ChatCompletionRequest, cls: type[Generation] = Generation, lora: LoRARequest | None = None
) -> Generation:
    """A chat request (decoded, its model checked: ``lora`` the adapter its name selects) made
    ready to submit; ``cls`` renders the answer (another API's shape, on the same request path)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    mode, tools = check_tools(body.tools, body.tool_choice)
    spec = structured_spec(body, chat=True)
    forced = tool_grammar(mode, tools, body.parallel_tool_calls)
    if forced is not None and spec is not None:
        raise bad_request(
            "tool_choice=required or a named tool cannot be combined with another "
            "structured-output constraint",
            "tool_choice",
        )
    check_fanout(state, 1, body.n)
    parser_cls = state.tool_parser if mode == "auto" else None
    ids, items = chat_prompt_ids(state, body, mode)
    if max_tokens is None:
        max_tokens = default_max_tokens(state, len(ids))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None

    reasoning_cls = state.reasoning_parser
    if state.harmony:  # the assistant's turn ends at <|return|> or <|call|>
        body = msgspec.structs.replace(body, stop_token_ids=[*(body.stop_token_ids or ()), *stop_token_ids()])
    if any(cls is not None and cls.needs_special_tokens for cls in (parser_cls, reasoning_cls)):
        body = msgspec.structs.replace(body, skip_special_tokens=False)  # the markers are special tokens

    def make_output() -> ChatOutput:
        parser = parser_cls(state.tokenizer) if parser_cls else None
        if parser is not None:
            parser.use_tools(tools)
        return ChatOutput(
            mode,
            parser,
            body.parallel_tool_calls,
            reasoning_cls(state.tokenizer) if reasoning_cls else None,
        )

    return cls(
        state,
        body,
        [(None, ids)],
        max_tokens,
        logprobs,
        chat=True,
        spec=forced or spec,
        make_output=make_output,
        lora=lora,
        mm_items=items,
    )


async def _prepared(state, prepare, data: bytes) -> Generation:
    """``prepare(state, data)`` on a worker thread; a model name no one serves yet is asked of
    the LoRA resolvers (with runtime loading on), and the request prepared again once one
    loaded it (a 404 if none has it)."""
    try:
        return await state.offload(prepare, state, data)
    except UnknownModel as exc:
        if state.lora is None or not state.lora.can_resolve:
            raise
        await state.lora.resolve(state.client, exc.name)
        return await state.offload(prepare, state, data)


async def generate(request: Request, prepare) -> Response:
    """A generation route: ``prepare(state, body bytes)`` on a worker thread makes the
    :class:`Generation`, which runs here."""
    state = request.app.state.server
    trace = state.tracing.start(request, request.url.path) if state.tracing is not None else None
    try:
        check_runner(state, "generate")
        data = await state.read(request)
        generation = await _prepared(state, prepare, data)
    except BaseException as exc:
        if trace is not None:
            trace.refused(exc)
        raise
    generation.trace = trace
    generation.cache_salt = salted(request.scope.get("state", {}).get("tenant_salt"), generation.cache_salt)
    return await generation.run(request)


async def completions(request: Request) -> Response:
    return await generate(request, prepare_completion)


async def chat_completions(request: Request) -> Response:
    return await generate(request, prepare_chat)
