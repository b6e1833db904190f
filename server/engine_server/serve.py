"""`engine serve`: the API process (starlette on uvicorn) and the engine-core process."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable

import uvicorn

from engine.client import EngineDead, exit_now, startup_plan
from engine.entrypoints.cli import AUTO_QUEUE, Command, add_engine_arguments, engine_options
from engine.entrypoints.harmony import encoding, is_harmony_model
from engine.entrypoints.tokenizer import resolve_model
from engine.interfaces import LoRAResolverContext
from engine.plugins import PluginRegistry, load_plugins
from engine_server.app import ServerState, build_app
from engine_server.errors import APIError
from engine_server.guard import default_allowed_hosts
from engine_server.header_timeout import with_header_timeout
from engine_server.images import load_image_input
from engine_server.lora import RESOLVER_CACHE_ENV, LoRAAdapters, runtime_updating_allowed
from engine_server.metrics import PREFIXES, Metrics
from engine_server.prefix_window import PrefixCacheWindow
from engine_server.replicas import ReplicaSet
from engine_server.responses_store import ResponseStore
from engine_server.serve_args import (
    add_server_arguments,
    api_keys,
    configure_request_log,
    load_serving_tokenizer,
    middleware,
)
from engine_server.tracing import Tracing

logger = logging.getLogger("engine_server")

DEATH_GRACE_SECONDS = 1.0  # after a core death: streams send their error frame, /health answers 503
CUT_FLUSH_SECONDS = 2.0  # after a drain is cut short, the time cut requests get to send their error


class _Server(uvicorn.Server):
    """uvicorn's server, telling ``on_drain`` when a signal starts the graceful shutdown."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None]):
        super().__init__(config)
        self.on_drain = on_drain

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.on_drain()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT/SIGTERM start uvicorn's graceful shutdown; afterwards the process exits
        normally (status 0) instead of re-raising the signal."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


class ServeCommand(Command):
    help = "serve a model over an OpenAI-compatible HTTP API"

    def add_arguments(self, parser):
        add_server_arguments(parser)
        parser.add_argument(
            "--metrics-prefix",
            choices=PREFIXES,
            default="vllm",
            help="prefix of the /metrics names: vllm (vLLM's names, for its dashboards) or "
            "engine (the engine: names of earlier releases); default: vllm",
        )
        add_engine_arguments(parser)

    def run(self, args) -> int:
        options = engine_options(args)
        if args.model_tag:
            if options.get("model", args.model_tag) != args.model_tag:
                raise ValueError(
                    f"model: given twice, as {args.model_tag!r} and --model {options['model']!r}"
                )
            options["model"] = args.model_tag
        if args.plugins:
            options["plugins"] = args.plugins
        if args.reasoning_parser:  # the engine's grammars then wait out the reasoning
            options["reasoning_parser"] = args.reasoning_parser
        # a server refuses (503) rather than queue without end; offline use queues everything
        options.setdefault("max_queued_requests", AUTO_QUEUE)
        if args.dry_run:
            print(startup_plan(options))
            return 0
        listener = listening_socket(args.host, args.port)  # a port taken fails now, not after loading
        registry = load_plugins(args.plugins)
        options["model"] = resolve_model(options.get("model"), args.plugins, options.get("load_format"))
        name = args.served_model_name or os.path.splitext(os.path.basename(options["model"].rstrip("/")))[0]
        harmony = is_harmony_model(options["model"])
        tool_parser, reasoning_parser = parsers(args, registry, harmony)
        adapters = lora_adapters(args, options, name, registry)
        outcome = {"exit_code": 0}
        server: _Server | None = None

        def on_death(reason: str) -> None:
            outcome["exit_code"] = 1
            asyncio.get_running_loop().call_later(DEATH_GRACE_SECONDS, setattr, server, "should_exit", True)

        def cut_drain() -> None:
            if client.cut_open_requests():
                logger.error(
                    "requests still running after --graceful-timeout %g s were ended with an error",
                    args.graceful_timeout,
                )
                outcome["exit_code"] = 1

        def on_drain() -> None:
            asyncio.get_running_loop().call_later(args.graceful_timeout, cut_drain)

        client = ReplicaSet(
            options,
            args.data_parallel_size,
            args.data_parallel_routing,
            on_death,
            step_timeout=args.engine_step_timeout,
        )
        client.launch()  # the cores import and load while this process prepares its own side
        try:
            state = server_state(
                args, options, client, name, adapters, tool_parser, reasoning_parser, harmony
            )
        except BaseException:
            client.abandon()
            raise
        metrics, tracing = state.metrics, state.tracing

        @contextlib.asynccontextmanager
        async def lifespan(app):
            try:
                ready = await client.start()
            except EngineDead as exc:  # one line naming the cause, not uvicorn's traceback
                print(f"engine serve: {exc}", file=sys.stderr)
                await client.shutdown()
                exit_now(1)
            state.max_model_len, state.vocab_size = ready.max_model_len, ready.vocab_size
            state.default_sampling_params = ready.default_sampling_params
            state.determinism = ready.determinism
            state.runner, state.embedding_size = ready.runner, ready.embedding_size
            state.matryoshka, state.matryoshka_dimensions = ready.matryoshka, ready.matryoshka_dimensions
            state.classifier_labels = ready.classifier_labels
            metrics.engine_ready(ready.cache_info, args.data_parallel_size)
            await _load_lora_modules(client, adapters, args.lora_modules or ())
            replicas = (
                f" on {args.data_parallel_size} data-parallel cores" if args.data_parallel_size > 1 else ""
            )
            print(ready.startup, flush=True)
            print(
                f"engine: serving {name}{replicas} at http://{args.host}:{args.port}/v1 (max_model_len "
                f"{ready.max_model_len}); try:\n  {_example_call(args, name, ready.runner)}"
                + (f"\n  or the web console: http://{args.host}:{args.port}/ui/" if state.web_ui else ""),
                flush=True,
            )
            try:
                yield
            finally:
                await client.shutdown()
                if tracing is not None:
                    tracing.shutdown()  # exports the spans still batched

        config = uvicorn.Config(
            build_app(state, lifespan, middleware(args)),
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            root_path=args.root_path,
            timeout_graceful_shutdown=args.graceful_timeout + CUT_FLUSH_SECONDS,
            **(
                {"http": with_header_timeout(args.request_header_timeout)}
                if args.request_header_timeout
                else {}
            ),
        )
        server = _Server(config, on_drain)
        server.run(sockets=[listener])
        if not server.started:
            print("engine serve: the server did not start (see the error above)", file=sys.stderr)
            return 1
        exit_now(outcome["exit_code"])  # the cores and sockets are closed; skip torch's teardown


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything loads, so that a port taken (another server
    still running) or an address not of this machine is one line at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(
                f"--port {port}: {host}:{port} is already in use (another server?); stop it or pick "
                "another --port"
            ) from None
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from None
    return sock


def lora_adapters(args, options: dict, name: str, registry: PluginRegistry) -> LoRAAdapters | None:
    """The server's adapters with ``--enable-lora`` (None without), its resolvers constructed;
    a ValueError for a LoRA flag given without it."""
    runtime = runtime_updating_allowed(args.allow_runtime_lora_updating)
    if not options.get("enable_lora"):
        given = [flag for flag, value in [("--lora-modules", args.lora_modules)] if value]
        given += ["--allow-runtime-lora-updating"] if args.allow_runtime_lora_updating else []
        if given:
            raise ValueError(f"{', '.join(given)} needs --enable-lora")
        return None
    cache_dir = args.lora_resolver_cache_dir or os.environ.get(RESOLVER_CACHE_ENV) or None
    context = LoRAResolverContext(name, cache_dir)
    resolvers = [r.load()(context) for r in registry.registrations("lora_resolvers")] if runtime else []
    return LoRAAdapters(name, runtime, args.lora_allowed_dir, resolvers)


async def _load_lora_modules(client, adapters: LoRAAdapters | None, modules) -> None:
    """Load ``--lora-modules`` into the started engine; one the engine refuses stops the server
    here, with one line naming it and the reason."""
    for module in modules:
        try:
            await adapters.add(client, module.name, module.path, module.base_model_name)
        except APIError as exc:
            print(f"engine serve: --lora-modules {module.name}={module.path}: {exc.message}", file=sys.stderr)
            await client.shutdown()
            exit_now(1)


def _example_call(args, name: str, runner: str) -> str:
    """A curl line for the route this server's runner serves."""
    route, body = (
        ("embeddings", '"input": "Hello!"')
        if runner == "pooling"
        else ("chat/completions", '"messages": [{"role": "user", "content": "Hello!"}]')
    )
    return (
        f"curl http://{args.host}:{args.port}/v1/{route} -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{name}", {body}}}\''
    )


def parsers(args, registry: PluginRegistry, harmony: bool) -> tuple[type, type | None]:
    """(tool parser, reasoning parser) classes: the flags', else the model's own. A gpt-oss model
    speaks harmony: its encoding is loaded now (a missing vocabulary fails at startup) and its
    parsers are ``openai`` and ``openai_gptoss``, as vLLM picks them. Checked before the cores
    launch, as the other flags that need no checkpoint loaded (a ValueError names the flag)."""
    if args.collect_detailed_traces and not args.otlp_traces_endpoint:
        raise ValueError("--collect-detailed-traces needs --otlp-traces-endpoint")
    if harmony:
        encoding()
    tool = args.tool_call_parser or ("openai" if harmony else "hermes")
    reasoning = args.reasoning_parser or ("openai_gptoss" if harmony else None)
    reasoning_cls = registry.get("reasoning_parsers", reasoning) if reasoning else None
    return registry.get("tool_parsers", tool), reasoning_cls


def server_state(
    args, options: dict, client: ReplicaSet, name: str, adapters, tool_parser, reasoning_parser, harmony: bool
) -> ServerState:
    """The API process's side of a server: the tokenizer and image processor, metrics and every
    request-handling flag (what needs no checkpoint is checked before the cores launch)."""
    model_path, tokenizer = load_serving_tokenizer(args, options)
    images = load_image_input(args, options, model_path)
    configure_request_log(args)
    tracing = (
        Tracing(name, args.otlp_traces_endpoint, bool(args.collect_detailed_traces))
        if args.otlp_traces_endpoint
        else None
    )
    metrics = Metrics(name, args.metrics_prefix)
    if adapters is not None:
        metrics.enable_lora(options.get("max_loras", 1))
    client.add_stats_listener(
        lambda engine: PrefixCacheWindow(functools.partial(metrics.update_engine, engine=engine))
    )
    return ServerState(
        client,
        tokenizer,
        name,
        0,
        0,
        metrics,
        tool_parser,
        reasoning_parser,
        harmony=harmony,
        api_keys=api_keys(args),
        api_key_cache_salt=not args.disable_api_key_cache_salt,
        allowed_hosts=default_allowed_hosts(args.host, args.allowed_hosts),
        max_body_bytes=args.max_request_body_bytes,
        body_timeout=args.request_body_timeout,
        max_response_bytes=args.max_response_bytes,
        max_request_budget=args.max_request_budget,
        max_request_sequences=args.max_request_sequences,
        log_requests=args.enable_log_requests,
        allow_unknown_fields=args.allow_unknown_fields,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        max_log_len=args.max_log_len,
        heartbeat_timeout=args.engine_heartbeat_timeout,
        keepalive_interval=args.stream_keepalive_interval or None,
        web_ui=not args.disable_web_ui,
        tracing=tracing,
        request_timings=args.enable_request_timings,
        lora=adapters,
        sleep_mode=bool(options.get("enable_sleep_mode")),
        images=images,
        responses=ResponseStore(args.responses_store_size, args.responses_store_ttl),
    )
