"""`engine serve`'s own flags (the engine's come from :mod:`engine.entrypoints.cli_args`), spelled as
`vllm serve` spells them, and what they set up: the tokenizer and chat template, the tool
and reasoning parsers, CORS, the root path and request logging."""

from __future__ import annotations

import argparse
import json
import logging
import os

from engine.client.protocol import HEARTBEAT_INTERVAL
from engine.entrypoints.cli import parse_count, parse_size
from engine.entrypoints.tokenizer import load_tokenizer
from engine_server.lora import RESOLVER_CACHE_ENV, RUNTIME_UPDATING_ENV, parse_lora_module
from engine_server.responses_store import DEFAULT_SIZE, DEFAULT_TTL
from engine_server.router import ROUTING
from engine_server.tracing import DETAIL_LEVELS

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
MIN_LIVENESS_LIMIT = 2 * HEARTBEAT_INTERVAL  # a shorter limit would take one late beat for a hang


def add_server_arguments(parser) -> None:
    group = parser.add_argument_group("server options")
    add = group.add_argument
    add(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="model folder or .gguf file, as `vllm serve MODEL` (same as --model)",
    )
    add(
        "--host",
        default="127.0.0.1",
        help="address to listen on; default: 127.0.0.1 (this machine only; "
        "vLLM listens on all interfaces: give --host 0.0.0.0 for that)",
    )
    add("--port", type=int, default=8000, help="default: 8000")
    add(
        "--api-key",
        nargs="+",
        action="extend",
        metavar="KEY",
        default=None,
        help="require `Authorization: Bearer KEY` (any of the keys given) on all routes but /health and "
        "the web console's page; each key's requests get their own prefix cache (see "
        "--disable-api-key-cache-salt); default: $ENGINE_API_KEY (keys separated by commas); may be given "
        "more than once",
    )
    add(
        "--disable-api-key-cache-salt",
        action="store_true",
        help="let requests under different API keys share prefix-cache blocks; by default each key's "
        "requests are salted apart (a cache_salt derived from the key, under any the request gives), "
        "so that no tenant can time another's prompts through prefix-cache hits",
    )
    add(
        "--allowed-hosts",
        type=_names,
        default=None,
        metavar="NAMES",
        help="Host header names the server answers to (others get a 421: DNS-rebinding protection), comma-"
        "separated or as JSON; *.example.com: its subdomains; *: any; default: localhost, 127.0.0.1 and ::1 "
        "when --host is a loopback address, any otherwise",
    )
    add(
        "--served-model-name",
        default=None,
        help="the model's name in the API; default: the checkpoint's base name",
    )
    add(
        "--tokenizer",
        default=None,
        help="a folder with another tokenizer (and chat template) for the model; default: the checkpoint's",
    )
    add(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one; default: the tokenizer's",
    )
    add(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls, for tool_choice=auto "
        "(a tool-parser plugin: hermes, llama3_json, mistral, pythonic, openai "
        "...); default: openai for gpt-oss (harmony), hermes otherwise",
    )
    add(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM command lines: tool_choice=auto is always on, with --tool-call-parser",
    )
    add(
        "--reasoning-parser",
        default=None,
        help="split reasoning into reasoning_content (a reasoning-parser "
        "plugin: deepseek_r1, qwen3, openai_gptoss ...); default: openai_gptoss for gpt-oss "
        "(harmony), none otherwise",
    )
    add("--max-request-body-bytes", type=int, default=4 * 2**20, help="unit: bytes; default: 4 MiB")
    add(
        "--request-body-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a request body must arrive within this long after its headers, else a 408 and the "
        "connection is closed (a client trickling its body must not hold a connection forever); "
        "0: no limit; default: 60",
    )
    add(
        "--request-header-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a request's headers must arrive within this long of the connection opening or of the "
        "previous response, else a 408 and the connection is closed (slowloris); 0: no limit; "
        "default: 30",
    )
    add(
        "--max-response-bytes",
        type=parse_size,
        default=64 * 2**20,
        metavar="BYTES",
        help="a response larger than this is refused with a 413 (code response_too_large; a stream ends with "
        "that error frame); sizes take units (64MiB); 0: no limit; default: 64 MiB",
    )
    add(
        "--max-request-budget",
        type=parse_count,
        default=4 * 2**20,
        metavar="N",
        help="n x (prompt + max_tokens) x (logprobs + 1), summed over a request's prompts (logprobs: the "
        "most of logprobs, top_logprobs and prompt_logprobs it asks for): more is a 400 naming the product; "
        "0: no limit; default: 4M (4,194,304: 256 sequences of 16k tokens, or 128 of 32k)",
    )
    add(
        "--max-request-sequences",
        type=int,
        default=256,
        help="engine requests one HTTP request may create (prompts x n); more is a 400; default: 256",
    )
    add(
        "--graceful-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish after SIGTERM; those still running then end with an "
        "error (code shutdown) and the exit status is 1; default: 10",
    )
    add_liveness_arguments(add)
    add_lora_arguments(parser.add_argument_group("LoRA adapters (with --enable-lora)").add_argument)
    _add_media_arguments(parser.add_argument_group("images in chat messages (image_url parts)").add_argument)
    add(
        "--allow-unknown-fields",
        action="store_true",
        help="ignore request fields this server does not implement (default: a 400 naming them)",
    )
    add(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprob tokens as "token_id:N" unless a request\'s return_tokens_as_token_ids says otherwise, '
        "as vLLM; default: off (decoded text)",
    )
    add(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix cache), "
        "as vLLM; default: off (the field is absent)",
    )
    add("--root-path", default="", help="the path prefix a proxy serves this server under (ASGI root_path)")
    add(
        "--allowed-origins",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="CORS: origins allowed to call the server from a browser, e.g. '[\"https://app.example\"]'; "
        "default: none (no CORS headers)",
    )
    add(
        "--allowed-methods",
        type=json.loads,
        default=["*"],
        metavar="JSON",
        help='CORS methods; default: ["*"]',
    )
    add(
        "--allowed-headers",
        type=json.loads,
        default=["*"],
        metavar="JSON",
        help='CORS headers; default: ["*"]',
    )
    add("--allow-credentials", action="store_true", help="CORS: allow credentials")
    add(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export a trace of every request to this OpenTelemetry collector (OTLP over HTTP/protobuf, "
        "e.g. http://localhost:4318/v1/traces; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc for gRPC): an "
        "llm_request span per request, a child of the caller's `traceparent`, with its queue, prefill, "
        "decode and API phases; needs the server's `tracing` extra",
    )
    add(
        "--collect-detailed-traces",
        type=_detail_levels,
        default=None,
        metavar="LEVELS",
        help="with --otlp-traces-endpoint, also record when each token delta arrived (an event per delta "
        "on the decode spans); vLLM's values, comma-separated: model, worker, all (each turns this on)",
    )
    add(
        "--enable-request-timings",
        action="store_true",
        help='put llama.cpp\'s "timings" object (queue, time to first token, prompt and decode times and '
        "rates) in every completion and chat response (a stream's last frame); without it a request asks "
        'with "timings": true',
    )
    add(
        "--responses-store-size",
        type=int,
        default=DEFAULT_SIZE,
        metavar="N",
        help="/v1/responses keeps the last N responses made with store: true (the default) in memory, for "
        "previous_response_id and GET /v1/responses/{id}; the oldest goes first; 0: keep none; "
        f"default: {DEFAULT_SIZE}",
    )
    add(
        "--responses-store-ttl",
        type=_non_negative_float,
        default=DEFAULT_TTL,
        metavar="SECONDS",
        help="a stored response is forgotten this long after it was made (then a 404, as for an unknown "
        f"id); default: {DEFAULT_TTL:g}",
    )
    add(
        "--dry-run",
        action="store_true",
        help="print the start-up plan (the parts chosen, memory by use: weights, KV cache in bytes and "
        "tokens, step graphs, activations) and exit without loading the weights or listening",
    )
    add(
        "--disable-web-ui",
        action="store_true",
        help="do not serve the web console (a chat playground and a live dashboard of /metrics) at /ui/; "
        "the page itself needs no API key, it asks for one and sends it with the calls it makes",
    )
    add(
        "--uvicorn-log-level",
        default="warning",
        choices=UVICORN_LOG_LEVELS,
        help=(
            "uvicorn's log level; info and below also log each HTTP request (the access log); "
            "default: warning"
        ),
    )
    add("--disable-uvicorn-access-log", action="store_true", help="no access log, whatever the log level")
    add(
        "--enable-log-requests", action="store_true", help="log each request's prompt and sampling parameters"
    )
    add(
        "--disable-log-requests",
        action="store_true",
        help="accepted for vLLM command lines: requests are logged only with --enable-log-requests",
    )
    add(
        "--max-log-len",
        type=int,
        default=None,
        help="characters (or token ids) of a prompt logged with --enable-log-requests; default: all",
    )
    add(
        "--data-parallel-size",
        "-dp",
        type=_positive_int,
        default=1,
        metavar="N",
        help="engine cores behind this server, each with its own copy of the model and KV cache (on a CPU "
        "each gets an equal share of the cores); a request goes to one of them; default: 1",
    )
    add(
        "--data-parallel-routing",
        choices=ROUTING,
        default="prefix",
        help="how a request's core is chosen with --data-parallel-size > 1: prefix (the core that was sent "
        "the longest prefix of its prompt, unless that core is much busier than the least busy one) or "
        "round-robin; default: prefix",
    )


def add_liveness_arguments(add) -> None:
    """The flags that make a hung engine core visible (docs/decisions.md, "Liveness")."""
    add(
        "--engine-heartbeat-timeout",
        type=_liveness_limit,
        default=30.0,
        metavar="SECONDS",
        help="/health answers 503 (naming the reason) while the engine core has requests in flight and "
        "shows no progress for this long: no heartbeat (its process sends one every "
        f"{HEARTBEAT_INTERVAL:g} s from a thread apart from the step loop: none means the process is stopped "
        "or frozen), or one step running this long (a hung or deadlocked step); 200 again once it moves; "
        "an idle core is never judged; default: 30",
    )
    add(
        "--engine-step-timeout",
        type=_liveness_limit,
        default=None,
        metavar="SECONDS",
        help="watchdog: when the engine core, with requests in flight, shows no progress for this long (as "
        "--engine-heartbeat-timeout judges it), its requests fail (a stream gets an error frame, any other "
        "request a 500, code engine_stalled), the core is killed and the server exits with status 1, for a "
        "supervisor to restart it; set it above the longest step you expect; default: off",
    )
    add(
        "--stream-keepalive-interval",
        type=_non_negative_float,
        default=15.0,
        metavar="SECONDS",
        help="a stream that waits this long for its next token gets a blank SSE line pair, which clients "
        "skip (vLLM's benchmark client too) and which keeps proxies from closing the idle "
        "connection; a stream whose first "
        "token takes this long starts without it (later errors come as error frames); 0: off; default: 15",
    )


def add_lora_arguments(add) -> None:
    """The server's LoRA flags (the engine's own, --enable-lora --max-loras --max-lora-rank
    --max-cpu-loras, are with the engine options)."""
    add(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=parse_lora_module,
        metavar="NAME=PATH",
        default=None,
        help="LoRA adapters served from the start, each selected by a request's model: NAME; PATH a PEFT "
        'folder; or vLLM\'s JSON form \'{"name": ..., "path": ..., "base_model_name": ...}\'. Each is '
        "checked against the model at start: one the engine would refuse stops the server with its reason",
    )
    add(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter "
        "{lora_name}, and ask the LoRA resolver plugins for adapter names nobody loaded; also on with "
        f"${RUNTIME_UPDATING_ENV}=True, as vLLM; default: off (those routes answer 404)",
    )
    add(
        "--lora-allowed-dir",
        default=None,
        metavar="DIR",
        help="runtime loads may only read adapters inside DIR (a relative lora_path is taken inside it; "
        "'..' and symlinks may not leave it); default: none, any folder the server can read, as vLLM "
        "(set it on a server whose clients you do not trust with the file system)",
    )
    add(
        "--lora-resolver-cache-dir",
        default=None,
        metavar="DIR",
        help="the folder LoRA resolvers read adapters from (the filesystem resolver: DIR/NAME for model "
        f"NAME); default: ${RESOLVER_CACHE_ENV}",
    )


def _add_media_arguments(add) -> None:
    """Where a chat request's ``image_url`` may point besides a base64 ``data:`` URL."""
    add(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="image_url parts may be file: URLs of files inside DIR ('..' and symlinks may not leave "
        "it); default: none, file: URLs are refused (a security risk: only in trusted environments)",
    )
    add(
        "--allowed-media-domains",
        nargs="+",
        action="extend",
        default=None,
        metavar="HOST",
        help="image_url parts may be http(s): URLs on these hosts, fetched by the server without "
        "redirects (host names as the URL spells them, any port); default: none, http(s) URLs are refused",
    )
    add(
        "--media-fetch-timeout",
        type=_positive_float,
        default=5.0,
        metavar="SECONDS",
        help="an http(s) image fetch (connecting and reading) gives up after this long (a 400); default: 5",
    )
    add(
        "--max-media-bytes",
        type=parse_size,
        default=20 * 2**20,
        metavar="BYTES",
        help="an image file (fetched, read or in a data: URL) larger than this is refused; default: 20 MiB",
    )


def _liveness_limit(text: str) -> float:
    value = float(text)
    if not value >= MIN_LIVENESS_LIMIT:  # NaN too
        raise argparse.ArgumentTypeError(
            f"must be at least {MIN_LIVENESS_LIMIT:g} s (two heartbeat intervals), got {text}"
        )
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def api_keys(args) -> tuple[str, ...]:
    """``--api-key``'s keys, else ``$ENGINE_API_KEY``'s (comma-separated)."""
    return tuple(args.api_key or _env_keys() or ())


def _env_keys() -> list[str] | None:
    keys = [key for key in os.environ.get("ENGINE_API_KEY", "").split(",") if key]
    return keys or None


def _names(text: str) -> list[str]:
    """``a.example,b.example`` or ``["a.example", "b.example"]``."""
    if text.lstrip().startswith("["):
        return [str(name) for name in json.loads(text)]
    return [name.strip() for name in text.split(",") if name.strip()]


def _detail_levels(text: str) -> list[str]:
    """vLLM's ``--collect-detailed-traces`` values: ``model,worker`` or ``all``."""
    levels = [level.strip() for level in text.split(",") if level.strip()]
    unknown = [level for level in levels if level not in DETAIL_LEVELS]
    if unknown or not levels:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(DETAIL_LEVELS)}")
    return levels


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def load_serving_tokenizer(args, options: dict):
    """-> (model path, tokenizer) for the API process: the checkpoint's tokenizer, or
    ``--tokenizer``'s, with ``--chat-template`` applied."""
    model_path, tokenizer = load_tokenizer(options.get("model"), args.plugins, options.get("load_format"))
    if args.tokenizer:
        _, tokenizer = load_tokenizer(args.tokenizer, args.plugins)
    if tokenizer is None:
        raise ValueError("model: serving needs a tokenizer and this checkpoint has none (give --tokenizer)")
    if args.chat_template:
        template = args.chat_template
        if os.path.exists(template):
            with open(template) as f:
                template = f.read()
        tokenizer.chat_template = template
    return model_path, tokenizer


def middleware(args) -> list[tuple[type, dict]]:
    """(middleware class, options) for ``--allowed-origins`` (CORS)."""
    if not args.allowed_origins:
        return []
    from starlette.middleware.cors import CORSMiddleware

    return [
        (
            CORSMiddleware,
            {
                "allow_origins": args.allowed_origins,
                "allow_methods": args.allowed_methods,
                "allow_headers": args.allowed_headers,
                "allow_credentials": args.allow_credentials,
            },
        )
    ]


def configure_request_log(args) -> None:
    if args.enable_log_requests:
        logging.getLogger("engine_server").setLevel(logging.INFO)
