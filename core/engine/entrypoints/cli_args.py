"""Engine options as command-line flags, spelled as vLLM spells them where the meaning
matches (``--gpu-memory-utilization``, ``--kv-cache-memory-bytes 4GiB``,
``--num-gpu-blocks-override``, ``-q``, ``-tp``, ``--dtype half``), so a ``vllm serve`` line
works unchanged; sizes take units (``4GiB``, ``32k``); ``--config FILE.yaml`` holds flags;
an unknown flag is refused in one line naming the closest known one.

Every :class:`engine.config.EngineConfig` option gets a flag; :data:`OPTIONS` says its
spellings, meaning and unit (``--help`` prints them with the default and the choices).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys

import attrs

from engine.config import AUTO_QUEUE, KV_CACHE_DTYPE_NAMES, EngineConfig

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMgGtT]?)(i?)([bB]?)\s*$")


def parse_size(text: str) -> int:
    """``4GiB``, ``4G`` (binary), ``4GB`` (decimal), ``512MiB``, ``1e9`` -> bytes."""
    match = _SIZE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB, 1e9)")
    number, unit, binary, byte = match.groups()
    power = " kmgt".index(unit.lower()) if unit else 0
    base = 1000 if (byte and not binary) else 1024
    return int(float(number) * base**power)


def parse_count(text: str) -> int:
    """Token counts as vLLM reads them: ``32k`` = 32,000, ``32K`` = 32,768, ``1m``, ``1M``."""
    match = re.fullmatch(r"\s*([0-9]+)\s*([kKmM]?)\s*", str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 4096, 32k, 32K)")
    number, unit = match.groups()
    scale = {"": 1, "k": 1000, "K": 1024, "m": 10**6, "M": 2**20}[unit]
    return int(number) * scale


_DTYPES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}


def parse_queue_bound(text: str) -> int:
    """``auto`` (:data:`engine.config.AUTO_QUEUE`) or a count."""
    if text.strip().lower() == "auto":
        return AUTO_QUEUE
    return parse_count(text)


def parse_dtype(text: str) -> str:
    if text not in _DTYPES:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(_DTYPES)}")
    return _DTYPES[text]


def parse_names(text: str) -> tuple[str, ...]:
    return tuple(name for name in text.split(",") if name)


def parse_sizes(text: str) -> tuple[int, ...]:
    """``1,2,4,8`` or ``"1 2 4 8"`` -> (1, 2, 4, 8)."""
    try:
        return tuple(int(part) for part in re.split(r"[,\s]+", text.strip()) if part)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of batch sizes: {text!r} (e.g. 1,2,4,8)") from None


@attrs.frozen
class Option:
    flags: tuple[str, ...]  # the first is shown first; vLLM's spelling leads where there is one
    help: str
    type: object = None  # a parser; None: the field's own type
    choices: tuple | None = None
    unit: str = ""


OPTIONS: dict[str, Option] = {
    "model": Option(
        ("--model",), "model folder (Hugging Face layout) or .gguf file; default: the embedded default model"
    ),
    "dtype": Option(
        ("--dtype",),
        "activation and weight dtype; half = float16, float = float32",
        parse_dtype,
        tuple(_DTYPES),
    ),
    "max_model_len": Option(
        ("--max-model-len",),
        "longest prompt plus output; default: the model's context",
        parse_count,
        unit="tokens (32k, 32K)",
    ),
    "load_format": Option(
        ("--load-format",), "checkpoint loader plugin (safetensors, gguf ...); default: by the file"
    ),
    "quantization": Option(
        ("--quantization", "-q"),
        "quant method plugin (int8-w8a16, int8-w8a8, fp8, unquantized ...); default: the checkpoint's",
    ),
    "seed": Option(("--seed",), "random seed of the engine"),
    "generation_config": Option(
        ("--generation-config",),
        "default sampling parameters for requests that "
        "do not set them: auto = the model's generation_config.json, vllm = none "
        "(the built-in defaults), or a folder holding a generation_config.json",
    ),
    "runner": Option(
        ("--runner",),
        "generate: sample tokens; pooling: one embedding or classification per prompt "
        "(/v1/embeddings, /score, /rerank, /classify); auto: pooling for a model without an LM head",
        choices=("auto", "generate", "pooling"),
    ),
    "task": Option(
        ("--task",),
        "vLLM's older spelling of --runner: embed, classify and score = pooling; default: --runner's",
        choices=("auto", "generate", "embed", "classify", "score"),
    ),
    "model_impl": Option(
        ("--model-impl",),
        "native: the model plugin that claims the architecture (vllm is an alias); transformers: "
        "transformers' own modelling code on the engine's paged KV cache (slower; any causal LM); "
        "auto: native where a plugin claims the architecture, else transformers",
        choices=("auto", "native", "vllm", "transformers"),
    ),
    "override_pooler_config": Option(
        ("--pooler-config", "--override-pooler-config"),
        'how a pooling model pools, as JSON: \'{"pooling_type": "MEAN", '
        "\"normalize\": false}' (LAST, CLS or MEAN); default: the model's pooler",
        json.loads,
    ),
    "hf_overrides": Option(
        ("--hf-overrides",),
        "keys set on the checkpoint's config, as JSON: '{\"architectures\": "
        '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}\' '
        "serves a Qwen3 causal LM as a yes/no reranker",
        json.loads,
    ),
    "block_size": Option(("--block-size",), "tokens per KV cache block", unit="tokens"),
    "kv_cache_memory": Option(
        ("--kv-cache-memory-bytes", "--kv-cache-memory"),
        "memory for the KV cache; overrides --gpu-memory-utilization",
        parse_size,
        unit="bytes (4GiB, 512MiB)",
    ),
    "kv_cache_memory_fraction": Option(
        ("--kv-cache-memory-fraction",), "share of free memory for the KV cache when no other size is given"
    ),
    "memory_utilization": Option(
        ("--gpu-memory-utilization", "--memory-utilization"),
        "share of the device's memory this instance may use in all (weights, "
        "activations, KV cache); the KV cache gets what the loaded model leaves",
        float,
    ),
    "num_blocks": Option(
        ("--num-gpu-blocks-override", "--num-blocks"), "KV cache blocks; overrides the memory options"
    ),
    "kv_cache_dtype": Option(
        ("--kv-cache-dtype",),
        "the KV cache's storage: auto = the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2 hold "
        "about twice the tokens in the same memory, scaled per layer by the checkpoint's "
        "k_scale/v_scale (else 1.0); float16 the bytes of bf16 with 3 more mantissa bits "
        "(under --dtype float32: half a float32 cache's bytes); the attention backend must read it",
        choices=KV_CACHE_DTYPE_NAMES,
    ),
    "calculate_kv_scales": Option(
        ("--calculate-kv-scales",),
        "with a quantized --kv-cache-dtype: each layer's scales from the first prefill's keys "
        "and values (max |k| / 200, max |v| / 100, as vLLM) instead of the checkpoint's or 1.0; "
        "decode steps then run eagerly (no step graphs)",
    ),
    "enable_prefix_caching": Option(
        ("--enable-prefix-caching",), "reuse KV blocks of shared prompt prefixes"
    ),
    "watermark": Option(("--watermark",), "share of KV blocks kept free when admitting requests"),
    "max_num_batched_tokens": Option(
        ("--max-num-batched-tokens",), "tokens per step (prefill and decode)", parse_count, unit="tokens"
    ),
    "max_num_seqs": Option(("--max-num-seqs",), "requests running at once"),
    "max_num_encoder_input_tokens": Option(
        ("--max-num-encoder-input-tokens",),
        "image tokens one step may encode (a multimodal model's encoder budget; an image "
        "longer is encoded in a step of its own); default: --max-num-batched-tokens",
        parse_count,
        unit="tokens",
    ),
    "enable_chunked_prefill": Option(("--enable-chunked-prefill",), "split long prompts over steps"),
    "num_scheduler_steps": Option(
        ("--num-scheduler-steps",),
        "greedy decode steps one scheduling pass may run in a row while every request runs and "
        "decodes greedily (a step graph replayed with its tokens fed back; tokens then arrive "
        "that many at a time); 1: one step per pass; default: 1 for engine serve, 8 offline",
    ),
    "long_prefill_token_threshold": Option(
        ("--long-prefill-token-threshold",),
        "most prompt tokens of one request per step; 0: no limit",
        parse_count,
        unit="tokens",
    ),
    "max_queued_requests": Option(
        ("--max-queued-requests",),
        "requests that may wait to run; a request beyond them is refused (HTTP 503 with Retry-After); "
        "0: no cap; auto: twice what can run at once (--max-num-seqs, and no more than the KV cache "
        "holds at --max-model-len), at least 64; default: auto for engine serve, 0 offline",
        parse_queue_bound,
    ),
    "max_queue_wait": Option(
        ("--max-queue-wait",),
        "longest a request may wait to start before it is refused (HTTP 503); 0: no limit",
        unit="seconds",
    ),
    "shared_step_target_s": Option(
        ("--shared-step-target-s",),
        "how long a step that prefills beside decoding "
        "requests should take; the prefill share adapts to it (0: a prompt may take "
        "the whole budget; offline LLM and engine generate default to 0, the "
        "server to 0.25)",
        unit="seconds",
    ),
    "policy": Option(
        ("--scheduling-policy", "--policy"), "order of waiting requests", choices=("fcfs", "priority")
    ),
    "scheduler": Option(("--scheduler",), "scheduler plugin"),
    "kv_cache_manager": Option(("--kv-cache-manager",), "KV cache manager plugin"),
    "tensor_parallel_size": Option(
        ("--tensor-parallel-size", "-tp"),
        "tensor-parallel ranks: each holds its share of every layer's heads and weights and its own KV cache",
    ),
    "distributed_executor_backend": Option(
        ("--distributed-executor-backend",),
        "where the ranks run: mp "
        "(local worker processes over torch.distributed), uni (this "
        "process, one rank) or an executor plugin's (ray: Ray actors on "
        "a cluster, plugin tessellm-executors-ray); default: uni for one "
        "rank, else mp",
    ),
    "distributed_timeout": Option(
        ("--distributed-timeout",),
        "longest any collective may take before the engine fails instead of hanging",
        unit="seconds",
    ),
    "log_stats": Option(("--log-stats",), "log engine statistics"),
    "enable_lora": Option(
        ("--enable-lora",),
        "serve LoRA adapters (PEFT folders) over the base model, mixed in every step; "
        "a request names its adapter (offline: lora_request=LoRARequest(name, id, path); "
        "engine serve: --lora-modules NAME=PATH, and model: NAME in the request)",
    ),
    "max_loras": Option(
        ("--max-loras",), "most distinct LoRA adapters in one step (each holds a slot of --max-lora-rank)"
    ),
    "max_lora_rank": Option(
        ("--max-lora-rank",), "highest LoRA rank an adapter may have (the slots' rank); higher is refused"
    ),
    "max_cpu_loras": Option(
        ("--max-cpu-loras",),
        "LoRA adapters kept loaded in memory, least recently used dropped beyond it; "
        "at least --max-loras; default: --max-loras",
        int,
    ),
    "limit_mm_per_prompt": Option(
        ("--limit-mm-per-prompt",),
        "most items per modality one prompt may carry, JSON, e.g. '{\"image\": 2}'; default: no limit",
        json.loads,
    ),
    "mm_processor_kwargs": Option(
        ("--mm-processor-kwargs",),
        "options for the model's image processor, JSON, e.g. '{\"max_pixels\": 802816}' (Qwen2-VL)",
        json.loads,
    ),
    "mm_encoder_cache_bytes": Option(
        ("--mm-encoder-cache-bytes",),
        "a multimodal model's encoder outputs kept by image hash, least recently used evicted "
        "(vLLM sizes its encoder cache in tokens and has no flag)",
        parse_size,
        unit="bytes",
    ),
    "speculative_config": Option(
        ("--speculative-config",),
        'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
        json.loads,
    ),
    "device": Option(
        ("--device",), "platform plugin (cpu, cuda, cpu-native ...); default: the best available"
    ),
    "attention_backend": Option(
        ("--attention-backend",), "attention backend plugin; default: the platform's preference"
    ),
    "structured_outputs_backend": Option(
        (
            "--structured-outputs-backend",
            "--structured-outputs-config.backend",  # vLLM's dotted form of the JSON flag's key
            "--guided-decoding-backend",
            "--grammar-backend",
        ),
        "grammar backend plugin (xgrammar, llguidance ...; guidance is vLLM's name for llguidance), "
        "or auto: per request the first installed backend that compiles it, in the order "
        "`engine plugins` lists; default: the highest-priority one (xgrammar)",
    ),
    "kv_connector": Option(
        ("--kv-connector",), "KV connector plugin (the short form of --kv-transfer-config)"
    ),
    "kv_events_config": Option(
        ("--kv-events-config",),
        "publish the prefix cache's KV events (blocks stored "
        'and removed) over ZMQ as vLLM does, JSON, e.g. \'{"enable_kv_cache_events": true, '
        '"endpoint": "tcp://*:5557"}\'',
        json.loads,
    ),
    "kv_transfer_config": Option(
        ("--kv-transfer-config",),
        "KV connector as JSON, vLLM's spelling, e.g. "
        '\'{"kv_connector": "offload", "kv_role": "kv_both", "kv_connector_extra_config": '
        '{"cpu_bytes": 1e9, "disk_path": "/tmp/kv", "disk_bytes": 1e10}}\'',
        json.loads,
    ),
    "batch_invariant": Option(
        ("--batch-invariant",),
        "make each request's output independent of the batch it runs in, bit for bit "
        "(matmuls and layer ops that compute each row alone, per-row attention; chunked "
        "prefill and prefix caching stay on where attention is chunk-invariant)",
    ),
    "logits_processors": Option(
        ("--logits-processors",), "logits processor plugins, comma-separated", parse_names
    ),
    "enforce_eager": Option(
        ("--enforce-eager",),
        "never record decode steps as step graphs (CUDA graphs on "
        "the cuda platform, native tapes on cpu-native); run every step eagerly",
    ),
    "enable_sleep_mode": Option(
        ("--enable-sleep-mode",),
        "allow the engine to sleep (engine serve: POST /sleep?level=1|2, /wake_up, GET "
        "/is_sleeping): level 1 gives the KV cache back and moves the weights to a temporary "
        "file, level 2 discards them (waking reloads the checkpoint), on every tensor-parallel "
        "rank; for a trainer sharing the machine. A KV connector must implement reset_cache "
        "(offload does; a P/D connector is refused)",
    ),
    "cuda_graph_sizes": Option(
        ("--cuda-graph-sizes",),
        "decode batch sizes to record as step graphs, "
        "comma-separated; default on cuda: 1, 2, 4, every 8 to 248, every 16 to 512; "
        "on cpu-native: every size (1 to 8 at start-up, up to 16 while a server is idle, the larger by "
        "the first step that needs one); up to --max-num-seqs",
        parse_sizes,
    ),
}

# Flags of vLLM's that have no effect here: (takes a value, why), printed when given.
NO_EFFECT = {
    "--trust-remote-code": (
        False,
        "this engine never runs code from a checkpoint (model families are plugins)",
    ),
    "--disable-log-stats": (False, "statistics are logged only with --log-stats"),
    "--swap-space": (True, "preempted requests are recomputed, not swapped"),
    "--revision": (True, "models load from local files only; there is no hub revision to pick"),
}

# plugins: handled before plugins load; reasoning_parser: engine serve's own --reasoning-parser
_SKIP = {"plugins", "reasoning_parser"}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag (and its vLLM spelling) per engine option, grouped under "engine options"."""
    group = parser.add_argument_group("engine options")
    for name, field in EngineConfig.option_names().items():
        if name in _SKIP:
            continue
        option = OPTIONS.get(name, Option((f"--{name.replace('_', '-')}",), ""))
        default = field.default
        details = [option.help] if option.help else []
        if option.unit:
            details.append(f"unit: {option.unit}")
        if "default:" not in option.help:
            details.append(f"default: {default}")
        help_text = "; ".join(details)
        metavar = {parse_size: "SIZE", parse_count: "N"}.get(option.type)
        if isinstance(default, bool):
            group.add_argument(
                *option.flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
            continue
        kind = option.type or (type(default) if isinstance(default, int | float) else _int_or_str)
        group.add_argument(
            *option.flags,
            dest=name,
            type=kind,
            default=None,
            help=help_text,
            choices=None if option.type is parse_dtype else option.choices,
            metavar=metavar if option.choices is None else "{" + ",".join(option.choices) + "}",
        )
    group.add_argument(
        "--structured-outputs-config",
        dest="structured_outputs_config",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='vLLM\'s structured-outputs options, e.g. \'{"backend": "llguidance"}\' '
        "(backend as --structured-outputs-backend; disable_fallback refuses auto)",
    )
    group.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="flags from a YAML mapping (max-num-seqs: 8); flags after --config override the file's",
    )
    for flag, (takes_value, reason) in NO_EFFECT.items():
        kind = {"metavar": "VALUE"} if takes_value else {"action": "store_const", "const": True}
        group.add_argument(
            flag,
            dest=_no_effect_dest(flag),
            default=None,
            help=f"accepted for vLLM command lines; no effect: {reason}",
            **kind,
        )


def _no_effect_dest(flag: str) -> str:
    return "no_effect_" + flag[2:].replace("-", "_")


def _int_or_str(value: str):
    return int(value) if value.isdigit() else value


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options given on the command line (a one-line note for each flag without effect)."""
    for flag, (_, reason) in NO_EFFECT.items():
        if getattr(args, _no_effect_dest(flag), None) is not None:
            print(f"engine: {flag} has no effect: {reason}", file=sys.stderr)
    names = (set(EngineConfig.option_names()) - _SKIP) | {"structured_outputs_config"}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def expand_config_files(argv: list[str]) -> list[str]:
    """``--config FILE.yaml`` -> the flags it holds (``max-num-seqs: 8`` or ``max_num_seqs: 8``;
    ``true`` for a bare flag, ``false`` for its ``--no-`` form) in its place, so flags after it
    override the file's."""
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--config" or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else next(args, None)
            if path is None:
                raise ValueError("--config needs a file")
            out += _config_flags(path)
        else:
            out.append(arg)
    return out


def _config_flags(path: str) -> list[str]:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")  # noqa: TRY004 (a usage error)
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return flags


class ArgumentParser(argparse.ArgumentParser):
    """Refuses an unknown flag in one line, naming the closest known flag. Abbreviations are
    refused too: with this many flags a prefix would pick one silently."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        unknown = re.search(r"unrecognized arguments: (\S+)", message)
        if unknown:
            flag = unknown.group(1).split("=")[0]
            known = [s for action in self._all_actions() for s in action.option_strings]
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else f"; see `{self.prog} --help`"
            self.exit(2, f"{self.prog}: unknown flag {flag}{hint}\n")
        super().error(message)

    def _all_actions(self):
        actions = list(self._actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    actions += sub._actions
        return actions
