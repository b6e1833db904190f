"""``/v1/responses``: OpenAI's Responses API. A request is translated into the chat request it
means (:mod:`engine_server.responses_input`) and runs down the chat route's path
(:class:`~engine_server.generation.Generation`: validation, template, tools, structured
outputs, metrics, tracing, abort on disconnect); only the answer's shape is this module's:
output items (:mod:`engine_server.responses_output`), the event stream with its sequence
numbers, and the stored responses that ``previous_response_id`` continues
(:mod:`engine_server.responses_store`). ``background`` is refused: every response is answered
on its own request."""

from __future__ import annotations

import functools
import json
import logging

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine.client import EngineDead
from engine_server import generation
from engine_server.errors import APIError, bad_request, internal_error
from engine_server.generation import Generation, chat_generation, check_model
from engine_server.keepalive import QUIET
from engine_server.responses_input import chat_request, input_items
from engine_server.responses_output import OutputItems, new_id
from engine_server.responses_store import StoredResponse
from engine_server.schemas import ResponsesRequest
from engine_server.validation import decode_body

logger = logging.getLogger("engine_server")

MAX_LIST_LIMIT = 100  # input items per page, as OpenAI
# the chat fields a refusal from the chat route's checks may name, and what this route calls them
CHAT_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "chat_template_kwargs": "reasoning",
}


@attrs.frozen
class Turn:
    """What a response adds to its conversation: the request, its own input items, and every
    item the model reads (the stored conversation it continues, then its input)."""

    body: ResponsesRequest
    input_items: list[dict]
    history: list[dict]


def prepare_response(state, data: bytes) -> ResponsesGeneration:
    """Decode, check, continue the stored conversation, translate; on a worker thread."""
    body: ResponsesRequest = decode_body(data, ResponsesRequest, state.allow_unknown_fields)
    lora = check_model(state, body.model)  # a LoRA adapter's name selects it here too
    if body.background:
        raise bad_request("background responses are not supported: leave background false", "background")
    if body.input is None:
        raise bad_request("input is required", "input")
    items = input_items(body.input)
    history = items
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id, "previous_response_id")
        history = previous.history + previous.response["output"] + items
    turn = Turn(body, items, history)
    try:
        return chat_generation(
            state, chat_request(body, history), functools.partial(ResponsesGeneration, turn), lora
        )
    except APIError as exc:  # the chat route's checks name chat's fields
        exc.param = CHAT_PARAMS.get(exc.param or "", exc.param)
        raise


class ResponsesGeneration(Generation):
    """A chat generation that answers as a Response: one object, or its event stream."""

    done_frame = None  # the last event says it all; there is no [DONE]

    def __init__(self, turn: Turn, *args, **kwargs):
        self.turn = turn
        self._sequence = 0  # events built
        self._sent = 0  # events sent
        super().__init__(*args, **kwargs)

    def _new_id(self) -> str:
        return new_id("resp")

    # -- the response object -----------------------------------------------------------
    def _response(self) -> dict:
        choice = self.choices[0]
        output = self.outputs[choice.request_id]
        items = OutputItems()
        items.feed(output.on_text(choice.text) + output.on_finish())
        status = self._status()
        items.close(status)
        return self._kept(self._object(status, items.items, self._usage(items.items)))

    def _status(self) -> str:
        return "incomplete" if self.choices[0].finish_reason == "length" else "completed"

    def _object(self, status: str, output: list[dict], usage: dict | None) -> dict:
        body = self.turn.body
        params = self.children[0][2]  # the sampling parameters, with the model's defaults
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.model_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None, **(body.reasoning or {})},
            "store": body.store,
            "temperature": params.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "top_p": params.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
        }

    def _usage(self, output: list[dict]) -> dict:
        """Token counts; the reasoning tokens are those of the reasoning text, re-tokenized."""
        choice = self.choices[0]
        prompt, generated = len(self.prompts[0][1]), len(choice.token_ids)
        thought = "".join(
            p["text"] for item in output if item["type"] == "reasoning" for p in item["content"]
        )
        reasoning = len(self.state.tokenizer.encode(thought, add_special_tokens=False)) if thought else 0
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": choice.num_cached_tokens},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": min(reasoning, generated)},
            "total_tokens": prompt + generated,
        }

    def _kept(self, response: dict) -> dict:
        """The finished response, stored for ``previous_response_id`` and GET unless ``store`` is false."""
        if self.turn.body.store:
            self.state.responses.put(StoredResponse(response, self.turn.input_items, self.turn.history))
        return response

    # -- the event stream --------------------------------------------------------------
    def _event(self, event: dict) -> str:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    def _error_frame(self, error: APIError) -> str:
        """An ``error`` event ends a stream that fails after it started. It follows the last
        event sent: one built but too large to send (``--max-response-bytes``) left no gap."""
        self._sequence = self._sent
        return self._event(
            {"type": "error", "code": error.code, "message": error.message, "param": error.param}
        )

    async def _frames(self):
        async for frame in super()._frames():
            self._sent += frame.startswith("event: ")
            yield frame

    async def _stream_frames(self):
        started = self._object("in_progress", [], None)
        yield self._event({"type": "response.created", "response": started})
        yield self._event({"type": "response.in_progress", "response": started})
        items = OutputItems()
        try:
            async for step in self._stream_steps():
                if step is QUIET:
                    yield self.keepalive_frame
                    continue
                if isinstance(step, APIError):
                    yield self._error_frame(step)
                    return
                choice, text, _ = step
                output = self.outputs[choice.request_id]
                deltas = (output.on_text(text) if text else []) + (
                    output.on_finish() if choice.finish_reason else []
                )
                for event in items.feed(deltas):
                    yield self._event(event)
            status = self._status()
            for event in items.close(status):
                yield self._event(event)
            response = self._kept(self._object(status, items.items, self._usage(items.items)))
            yield self._event({"type": f"response.{status}", "response": response})
        except EngineDead as exc:
            yield self._error_frame(self._engine_dead(exc))
        except Exception:
            logger.exception("request %s: internal error while streaming", self.id)
            yield self._error_frame(internal_error(self.id))


async def create(request: Request):
    return await generation.generate(request, prepare_response)


async def retrieve(request: Request):
    state = request.app.state.server
    return JSONResponse(state.responses.get(request.path_params["response_id"]).response)


async def delete(request: Request):
    response_id = request.path_params["response_id"]
    request.app.state.server.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def list_input_items(request: Request):
    """A stored response's own input items, a page at a time (``limit``, ``order``, ``after``)."""
    state = request.app.state.server
    items = state.responses.get(request.path_params["response_id"]).input_items
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc", "order")
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIST_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}", "limit")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_request(f"after: no input item {after[:100]!r} in this response", "after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[: int(limit)]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(ordered) > len(page),
        }
    )


def routes() -> list[Route]:
    return [
        Route("/v1/responses", create, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
    ]
