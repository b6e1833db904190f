"""EngineConfig: built and validated once, the context every constructor receives."""

from __future__ import annotations

from typing import Any

import attrs

from engine.messages.kv_events import KVEventsConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# engine.interfaces.attention maps them
KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "float16")


def _one_of(choices: tuple[str, ...]):
    def check(instance, attribute, value):
        if value not in choices:
            raise ValueError(f"{attribute.name}: {value!r} is not one of {', '.join(choices)}")

    return check


def _positive(instance, attribute, value):
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


def _non_negative(instance, attribute, value):
    if value < 0:
        raise ValueError(f"{attribute.name} must be non-negative, got {value}")


AUTO_QUEUE = -1  # max_queued_requests: derived from max_num_seqs and the KV cache (engine serve's default)
MIN_AUTO_QUEUE = 64  # the least an automatic queue bound allows


AUTO_GRAMMAR = "auto"  # structured_outputs_backend: per request, the first installed backend that compiles it
# vLLM's names of grammar backends registered here under another name
VLLM_GRAMMAR_NAMES = {"guidance": "llguidance"}
# vLLM's StructuredOutputsConfig keys that change nothing here, and why
STRUCTURED_OUTPUTS_NO_EFFECT = {
    "disable_any_whitespace": "JSON is always generated in json.dumps's layout, with no free whitespace",
    "disable_additional_properties": "a schema's additionalProperties is followed as written",
}
# vLLM's StructuredOutputsConfig keys that are engine options here
STRUCTURED_OUTPUTS_OPTIONS = ("reasoning_parser", "enable_in_reasoning")


def grammar_backend_option(kwargs: dict[str, Any]) -> None:
    """Fold vLLM's spellings of the grammar backend into ``structured_outputs_backend``, in place:
    ``structured_outputs_config`` (a dict or its JSON text: ``backend``, ``disable_fallback``
    and keys of no effect here; ``reasoning_parser`` and ``enable_in_reasoning`` become the
    engine options of those names), ``guided_decoding_backend`` (vLLM's older flag) and vLLM's
    backend names (``guidance`` is ``llguidance``). ValueError for an unknown key or for two
    spellings naming different backends."""
    import json
    import logging

    config = kwargs.pop("structured_outputs_config", None) or {}
    if isinstance(config, str):
        config = json.loads(config)
    if not isinstance(config, dict):
        raise ValueError(f"structured_outputs_config must be a JSON object, got {config!r}")  # noqa: TRY004
    unknown = set(config) - {
        "backend",
        "disable_fallback",
        *STRUCTURED_OUTPUTS_NO_EFFECT,
        *STRUCTURED_OUTPUTS_OPTIONS,
    }
    if unknown:
        raise ValueError(f"structured_outputs_config: unknown key(s) {', '.join(sorted(unknown))}")
    for key in set(config) & set(STRUCTURED_OUTPUTS_NO_EFFECT):
        logging.getLogger(__name__).warning(
            "structured_outputs_config.%s has no effect: %s", key, STRUCTURED_OUTPUTS_NO_EFFECT[key]
        )
    for key in STRUCTURED_OUTPUTS_OPTIONS:
        if key in config:
            if kwargs.get(key) not in (None, config[key]):
                raise ValueError(f"conflicting {key}: {kwargs[key]!r} and structured_outputs_config's")
            kwargs[key] = config[key]
    given = {
        spelling: VLLM_GRAMMAR_NAMES.get(name, name)
        for spelling, name in (
            ("structured_outputs_backend", kwargs.pop("structured_outputs_backend", None)),
            ("guided_decoding_backend", kwargs.pop("guided_decoding_backend", None)),
            ("structured_outputs_config.backend", config.get("backend")),
        )
        if name is not None
    }
    if len(set(given.values())) > 1:
        raise ValueError(f"conflicting grammar backends: {given}")
    name = next(iter(given.values()), None)
    if config.get("disable_fallback") and name == AUTO_GRAMMAR:
        raise ValueError("structured_outputs_config: disable_fallback with backend auto: name one backend")
    if name is not None:
        kwargs["structured_outputs_backend"] = name


def _queue_bound(instance, attribute, value):
    if value < 0 and value != AUTO_QUEUE:
        raise ValueError(f"{attribute.name} must be non-negative or auto ({AUTO_QUEUE}), got {value}")


def auto_queue_bound(max_num_seqs: int, kv_tokens: int, max_model_len: int) -> int:
    """The waiting requests a server admits by default: two batches' worth, where a batch is
    what can run at once (``max_num_seqs``, and no more than the KV cache holds at full
    context, which every running request may grow to), and at least :data:`MIN_AUTO_QUEUE`
    (a small cache must still queue one request's fan-out). A request refused at once with
    a 503 and Retry-After can go to another replica; one queued behind hundreds waits
    minutes and then times out anyway."""
    batch = min(max_num_seqs, max(1, kv_tokens // max_model_len))
    return max(MIN_AUTO_QUEUE, 2 * batch)


@attrs.frozen
class ModelConfig:
    model: str | None = None  # None: the default model a loader plugin ships
    dtype: str = attrs.field(default="auto", validator=attrs.validators.in_(_DTYPES))
    max_model_len: int | None = attrs.field(default=None, validator=_positive)
    load_format: str | None = None
    quantization: str | None = None
    seed: int = 0
    # default sampling parameters: "auto" (the model's generation config), "vllm" (none), or a folder
    generation_config: str = "auto"
    # vLLM's --runner: "generate" samples tokens, "pooling" returns one vector per prompt
    # (embeddings, classifications); "auto": pooling for a model without an LM head. --task embed,
    # classify or score is pooling.
    runner: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "generate", "pooling")))
    task: str | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(
            attrs.validators.in_(("auto", "generate", "embed", "classify", "score"))
        ),
    )
    # vLLM's --pooler-config: {"pooling_type": "LAST" | "CLS" | "MEAN", "normalize": bool}
    override_pooler_config: dict[str, Any] | None = None
    # vLLM's --hf-overrides: keys set on the checkpoint's config before the model is chosen
    # ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]})
    hf_overrides: dict[str, Any] | None = None
    # vLLM's --model-impl: "native" (vLLM spells it "vllm") runs the model plugin that claims the
    # architecture; "transformers" runs transformers' own modelling code through the registered
    # fallback (engine.interfaces.FALLBACK_ARCHITECTURE); "auto": native where a plugin claims
    # the architecture, else the fallback
    model_impl: str = attrs.field(
        default="auto",
        converter=lambda value: "native" if value == "vllm" else value,
        validator=attrs.validators.in_(("auto", "native", "transformers")),
    )


@attrs.frozen
class CacheConfig:
    block_size: int = attrs.field(default=16, validator=_positive)
    kv_cache_memory: int | None = attrs.field(default=None, validator=_positive)  # bytes
    kv_cache_memory_fraction: float = 0.25  # of free memory, when no other size is given
    # vLLM's --gpu-memory-utilization: share of the device's memory for the whole instance
    memory_utilization: float | None = attrs.field(
        default=None, validator=attrs.validators.optional([attrs.validators.gt(0), attrs.validators.le(1)])
    )
    num_blocks: int | None = attrs.field(default=None, validator=_positive)  # overrides both
    enable_prefix_caching: bool = True
    # vLLM's --kv-cache-dtype: "auto" (the activation dtype) or an 8-bit float the KV cache is
    # stored in ("fp8" = "fp8_e4m3"; engine.interfaces.attention.KV_CACHE_DTYPES), scaled per
    # layer by the checkpoint's k_scale / v_scale, else 1.0
    kv_cache_dtype: str = attrs.field(default="auto", validator=_one_of(KV_CACHE_DTYPE_NAMES))
    # vLLM's --calculate-kv-scales: a quantized cache's per-layer scales from the first prefill's
    # keys and values (max |k| / 200, max |v| / 100) instead of the checkpoint's or 1.0
    calculate_kv_scales: bool = False
    watermark: float = 0.01  # fraction of blocks kept free when admitting new requests


@attrs.frozen
class SchedulerConfig:
    max_num_batched_tokens: int = attrs.field(default=2048, validator=_positive)
    max_num_seqs: int = attrs.field(default=256, validator=_positive)
    # vLLM's: image tokens a step may encode (a multimodal model's encoder budget); None:
    # max_num_batched_tokens
    max_num_encoder_input_tokens: int | None = attrs.field(default=None, validator=_positive)
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk may use the whole budget
    # while some request decodes, prefill chunks together are sized (measured online) so that
    # a step takes about this long: the other streams' inter-token gap; 0: the whole budget
    shared_step_target_s: float = attrs.field(default=0.25, validator=attrs.validators.ge(0))
    policy: str = attrs.field(default="fcfs", validator=attrs.validators.in_(("fcfs", "priority")))
    # vLLM V0's multi-step scheduling, for greedy decoding: while every unfinished request runs
    # and decodes greedily, a scheduling pass may run up to this many decode steps in a row
    # (engine.core.lifecycle.RequestLifecycle.with_burst); 1: one step per pass
    num_scheduler_steps: int = attrs.field(default=1, validator=_positive)
    # admission control: beyond these a new request is refused as overloaded (0: no limit)
    # waiting requests; AUTO_QUEUE: auto_queue_bound() once the KV cache is sized
    max_queued_requests: int = attrs.field(default=0, validator=_queue_bound)
    max_queue_wait: float = attrs.field(
        default=0.0, validator=_non_negative
    )  # seconds before first scheduled
    scheduler: str = "default"
    kv_cache_manager: str = "default"


@attrs.frozen
class ParallelConfig:
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive)
    # vLLM's --distributed-executor-backend: "mp" (local worker processes), "uni" (this
    # process; one rank), or an executor plugin's name ("ray"); None: uni for one rank, else mp
    distributed_executor_backend: str | None = None
    # seconds any collective (and a worker's wait for the next step) may take before the
    # engine fails instead of hanging
    distributed_timeout: float = attrs.field(default=60.0, validator=_positive)


@attrs.frozen
class LoRAConfig:
    """vLLM's LoRA options: ``max_loras`` adapters may run in one step (each in a fixed slot of
    rank ``max_lora_rank``), ``max_cpu_loras`` stay loaded in memory (None: ``max_loras``),
    the least recently used beyond that are dropped and read again when asked for."""

    enable_lora: bool = False
    max_loras: int = attrs.field(default=1, validator=_positive)
    max_lora_rank: int = attrs.field(default=16, validator=_positive)
    max_cpu_loras: int | None = attrs.field(default=None, validator=_positive)

    def __attrs_post_init__(self):
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})"
            )

    @property
    def cpu_loras(self) -> int:
        """How many adapters stay loaded in memory."""
        return self.max_cpu_loras or self.max_loras


@attrs.frozen
class MultiModalConfig:
    """Images for a multimodal model. ``limit_mm_per_prompt`` (vLLM's flag): most items of
    each modality one prompt may carry, e.g. ``{"image": 2}`` (None: no limit).
    ``mm_encoder_cache_bytes``: the encoder cache's size (``engine.runner.encoder_cache``); vLLM
    sizes its encoder cache in tokens from the scheduler's budget and has no flag for it.
    ``mm_processor_kwargs`` (vLLM's flag): options for the model's processor, e.g. Qwen2-VL's
    ``{"max_pixels": ...}``; one whose processor takes none is refused at start."""

    limit_mm_per_prompt: dict[str, int] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    mm_encoder_cache_bytes: int = attrs.field(default=256 * 1024 * 1024, validator=_non_negative)


@attrs.frozen
class ObservabilityConfig:
    log_stats: bool = False


@attrs.frozen
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    lora: LoRAConfig = LoRAConfig()
    multimodal: MultiModalConfig = MultiModalConfig()
    speculative_config: dict[str, Any] | None = None  # {"method": NAME, "num_speculative_tokens": K, ...}
    plugins: tuple[str, ...] | None = None  # allow-list of entry-point names; None: all installed
    device: str | None = None  # platform name; None: the best available
    attention_backend: str | None = None
    # a grammar backend's name, "auto" (AUTO_GRAMMAR) or None: the registry's default; from_kwargs
    # also takes vLLM's structured_outputs_config and guided_decoding_backend (grammar_backend_option)
    structured_outputs_backend: str | None = None
    # the reasoning parser's name (engine serve --reasoning-parser): grammars then apply only after
    # its reasoning block (engine.core.reasoning_gate), unless enable_in_reasoning
    reasoning_parser: str | None = None
    enable_in_reasoning: bool = False
    kv_connector: str | None = None
    # vLLM's --kv-events-config: {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", ...}
    kv_events_config: KVEventsConfig | None = attrs.field(default=None, converter=KVEventsConfig.from_dict)
    # {"kv_connector": NAME, "kv_role": "kv_both", "kv_connector_extra_config": {...}} (vLLM's spelling)
    kv_transfer_config: dict[str, Any] | None = None
    logits_processors: tuple[str, ...] = ()
    # a request's greedy output does not depend on what else is batched with it, on chunking
    # or on speculation (see engine.layers.batch_invariant); costs throughput
    batch_invariant: bool = False
    # decode steps recorded once per batch size and replayed (engine.runner.step_graphs: CUDA
    # graphs on cuda, native tapes on cpu-native): off with enforce_eager; the batch sizes
    # recorded (None: the platform's default list up to max_num_seqs)
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    # /sleep and /wake_up (engine.core.sleep): the KV cache and weights given back while asleep
    enable_sleep_mode: bool = False

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Build from flat keyword arguments (``LLM(...)``, CLI flags), each routed to its
        sub-config; an unknown name raises TypeError naming it."""
        sections = {
            "model": ModelConfig,
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "parallel": ParallelConfig,
            "observability": ObservabilityConfig,
            "lora": LoRAConfig,
            "multimodal": MultiModalConfig,
        }
        kwargs = dict(kwargs)
        grammar_backend_option(kwargs)
        parts: dict[str, dict[str, Any]] = {name: {} for name in sections}
        top: dict[str, Any] = {}
        top_fields = {f.name for f in attrs.fields(cls)} - set(sections)
        for key, value in kwargs.items():
            section = next((s for s, c in sections.items() if key in attrs.fields_dict(c)), None)
            if section is not None:
                parts[section][key] = value
            elif key in top_fields:
                top[key] = value
            else:
                raise TypeError(f"unknown engine option {key!r}")
        for key in ("plugins", "logits_processors"):
            if isinstance(top.get(key), (list, str)):
                value = top[key]
                top[key] = tuple(value.split(",") if isinstance(value, str) else value)
        if isinstance(top.get("cuda_graph_sizes"), list):
            top["cuda_graph_sizes"] = tuple(top["cuda_graph_sizes"])
        return cls(**{s: c(**parts[s]) for s, c in sections.items()}, **top)

    @staticmethod
    def option_names() -> dict[str, attrs.Attribute]:
        """Every flat option name with its attribute (for CLI flags)."""
        names = {}
        for f in attrs.fields(EngineConfig):
            if attrs.has(type(f.default)):  # a sub-config: its fields are the options
                names.update(attrs.fields_dict(type(f.default)))
            else:
                names[f.name] = f
        return names
