"""`engine proxy`: the front of a prefill/decode-disaggregated deployment, vLLM's P/D proxy flow.

Each `/v1/completions` or `/v1/chat/completions` request goes first to a prefill instance with
``max_tokens=1``, ``stream=false`` and ``kv_transfer_params={"do_remote_decode": true}``; the
``kv_transfer_params`` of its response (where its KV blocks are) are added to the original request,
which goes to a decode instance, whose answer (a stream or one response) is the client's. Instances
are `engine serve` processes started with `--kv-transfer-config` (`kv_role` `kv_producer` /
`kv_consumer`); several of each are used in turn.

    engine proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
    engine proxy --prefiller-hosts 127.0.0.1 --prefiller-ports 8100 \\
                 --decoder-hosts 127.0.0.1 --decoder-ports 8200          # vLLM's toy proxy's flags

An instance's own error (a 4xx, an overload) is forwarded as it came; an instance that cannot be
reached or fails mid-answer becomes a 502 (or, mid-stream, an error frame), OpenAI-shaped, for
that request alone.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import uuid

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.entrypoints.cli import Command
from engine_server.errors import APIError, bad_request

logger = logging.getLogger("engine_server.proxy")

# what the prefill instance must not do: stream, sample more than the first token, hold back min tokens
_PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")
_FORWARDED_HEADERS = ("authorization", "x-request-id")
HEALTH_TIMEOUT = 5.0  # seconds an instance has to answer /health


class ProxyCommand(Command):
    help = "route OpenAI requests through prefill instances to decode instances (P/D disaggregation)"

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument(
            "--prefill",
            nargs="+",
            default=[],
            metavar="URL",
            help="prefill instances (kv_role kv_producer), e.g. http://127.0.0.1:8100",
        )
        parser.add_argument(
            "--decode",
            nargs="+",
            default=[],
            metavar="URL",
            help="decode instances (kv_role kv_consumer), e.g. http://127.0.0.1:8200",
        )
        for side in ("prefiller", "decoder"):
            parser.add_argument(
                f"--{side}-hosts",
                f"--{side}-host",
                nargs="+",
                default=[],
                help=f"vLLM's toy proxy's spelling: {side} hosts, paired with --{side}-ports",
            )
            parser.add_argument(f"--{side}-ports", f"--{side}-port", nargs="+", type=int, default=[])
        parser.add_argument(
            "--timeout",
            type=float,
            default=None,
            help="seconds an instance may take to answer (default: no limit)",
        )
        parser.add_argument("--uvicorn-log-level", default="warning")

    def run(self, args) -> int:
        prefill = args.prefill + _paired(args.prefiller_hosts, args.prefiller_ports, "prefiller")
        decode = args.decode + _paired(args.decoder_hosts, args.decoder_ports, "decoder")
        if not prefill or not decode:
            raise ValueError(
                "engine proxy: give at least one prefill and one decode instance "
                "(--prefill URL / --decode URL)"
            )
        app = build_proxy(prefill, decode, args.timeout)
        print(f"P/D proxy on http://{args.host}:{args.port}: prefill {prefill}, decode {decode}", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
        return 0


def _paired(hosts: list[str], ports: list[int], side: str) -> list[str]:
    if len(hosts) != len(ports):
        raise ValueError(f"engine proxy: {len(hosts)} --{side}-hosts for {len(ports)} --{side}-ports")
    return [f"http://{host}:{port}" for host, port in zip(hosts, ports)]


class Upstreams:
    """The instances of one side, used in turn."""

    def __init__(self, urls: list[str]):
        self.urls = [url.rstrip("/") for url in urls]
        self._turn = itertools.cycle(self.urls)

    def next(self) -> str:
        return next(self._turn)


def bad_gateway(side: str, url: str, exc: Exception) -> APIError:
    return APIError(
        502,
        f"the {side} instance {url} failed: {type(exc).__name__}: {exc}".strip(),
        code=f"{side}_unavailable",
        type_="BadGatewayError",
    )


def build_proxy(prefill_urls: list[str], decode_urls: list[str], timeout: float | None = None) -> Starlette:
    prefill, decode = Upstreams(prefill_urls), Upstreams(decode_urls)
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(timeout),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )

    async def generate(request: Request) -> Response:
        path = request.url.path
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return bad_request(f"the body is not JSON: {exc}").response()
        if not isinstance(body, dict):
            return bad_request("the body is not a JSON object").response()
        headers = _forwarded(request)
        headers.setdefault("x-request-id", uuid.uuid4().hex)
        try:
            params = await _prefill(client, prefill.next(), path, body, headers)
        except _Answer as answer:
            return answer.response
        decode_body = {**body, "kv_transfer_params": params} if params else body
        if body.get("stream"):
            return await _stream(client, decode.next(), path, decode_body, headers)
        return await _forward(client, decode.next(), path, decode_body, headers)

    async def passthrough(request: Request) -> Response:
        """Routes any instance answers alike (the model list, the tokenizer): the first decode
        instance's answer."""
        url = decode.urls[0]
        try:
            upstream = await client.request(
                request.method,
                url + request.url.path,
                content=await request.body(),
                headers={**_forwarded(request), "content-type": "application/json"},
            )
        except httpx.HTTPError as exc:
            return bad_gateway("decode", url, exc).response()
        return Response(upstream.content, upstream.status_code, media_type="application/json")

    async def health(request: Request) -> Response:
        states = {}
        for url in prefill.urls + decode.urls:
            try:
                states[url] = (await client.get(url + "/health", timeout=HEALTH_TIMEOUT)).status_code
            except httpx.HTTPError:
                states[url] = None
        healthy = all(code == 200 for code in states.values())
        return JSONResponse({"instances": states}, status_code=200 if healthy else 503)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    routes = [
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/models", passthrough, methods=["GET"]),
        Route("/tokenize", passthrough, methods=["POST"]),
        Route("/detokenize", passthrough, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def _forwarded(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k in _FORWARDED_HEADERS}


class _Answer(Exception):
    """Control flow: the response to give the client now."""

    def __init__(self, response: Response):
        self.response = response


async def _prefill(client: httpx.AsyncClient, url: str, path: str, body: dict, headers: dict) -> dict | None:
    """The prefill instance's ``kv_transfer_params`` for this request (None: it hands nothing on,
    e.g. its first token ended the request; the decode instance then computes the prompt)."""
    prefill_body = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    prefill_body.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in prefill_body:
        prefill_body["max_completion_tokens"] = 1
    try:
        upstream = await client.post(url + path, json=prefill_body, headers=headers)
    except httpx.HTTPError as exc:
        logger.warning("prefill %s: %s", url, exc)
        raise _Answer(bad_gateway("prefill", url, exc).response()) from None
    if upstream.status_code != 200:  # the instance's own OpenAI-shaped error
        raise _Answer(Response(upstream.content, upstream.status_code, media_type="application/json"))
    try:
        return upstream.json().get("kv_transfer_params")
    except ValueError as exc:
        raise _Answer(bad_gateway("prefill", url, exc).response()) from None


async def _forward(client: httpx.AsyncClient, url: str, path: str, body: dict, headers: dict) -> Response:
    try:
        upstream = await client.post(url + path, json=body, headers=headers)
    except httpx.HTTPError as exc:
        logger.warning("decode %s: %s", url, exc)
        return bad_gateway("decode", url, exc).response()
    return Response(upstream.content, upstream.status_code, media_type="application/json")


async def _stream(client: httpx.AsyncClient, url: str, path: str, body: dict, headers: dict) -> Response:
    """The decode instance's SSE stream, passed through; its failure mid-stream becomes an error
    frame. Closing the stream (the client left) closes the upstream one: the instance aborts."""
    try:
        upstream = await client.send(
            client.build_request("POST", url + path, json=body, headers=headers), stream=True
        )
    except httpx.HTTPError as exc:
        logger.warning("decode %s: %s", url, exc)
        return bad_gateway("decode", url, exc).response()
    if upstream.status_code != 200:
        content = await upstream.aread()
        await upstream.aclose()
        return Response(content, upstream.status_code, media_type="application/json")

    async def frames():
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            logger.warning("decode %s: the stream broke: %s", url, exc)
            yield "data: " + json.dumps(bad_gateway("decode", url, exc).body()) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await upstream.aclose()

    return StreamingResponse(frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
