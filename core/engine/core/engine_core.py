"""EngineCore: the step loop.

schedule → flatten the batch → model forward → logits processors and grammar masks →
sampler (verifying drafts) → apply the result (the request lifecycle) → outputs → propose
next drafts.
"""

from __future__ import annotations

import datetime
import functools
import logging
import time

import attrs
import torch

from engine.config import AUTO_GRAMMAR, EngineConfig
from engine.core import faults, kv_connectors, kv_sizing, setup, startup, weight_sync
from engine.core.hf_overrides import apply_hf_overrides
from engine.core.lifecycle import request_path
from engine.core.reasoning_gate import reasoning_markers
from engine.core.sleep import SleepMode, named_tensors
from engine.core.speculation import Speculator
from engine.core.step_stats import StepTokenHistogram
from engine.core.structured import StructuredOutputs
from engine.interfaces import ExecutorFailure, GrammarContext, KVConnector, MultiModalProcessor
from engine.interfaces.attention import kv_dtype_name
from engine.lora.manager import LoRAManager
from engine.messages import generation_config
from engine.messages.lora import LoRARequest
from engine.messages.multimodal import MultiModalItem, build_processor, check_mm_items, no_images_reason
from engine.messages.pooling_params import PoolingParams, matryoshka_of
from engine.messages.request import Request
from engine.messages.request_path import check_prompt
from engine.messages.sampling_params import InvalidParam, SamplingParams, check_int64
from engine.messages.step import (
    OVERLOADED,
    Asleep,
    EngineOutput,
    RequestTiming,
    StepPlan,
    StepResult,
)
from engine.plugins import PluginRegistry
from engine.runner import step_graphs
from engine.runner.encoder_cache import EncoderCache
from engine.runner.model_runner import ModelRunner
from engine.runner.pooling import Pooler, PoolerConfig, resolve_runner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, registry: PluginRegistry, record_while_idle: bool = False):
        """``registry``: the plugins the engine selects its parts from; whoever builds the
        engine loads them (:func:`engine.plugins.load_plugins` with ``config.plugins``).
        ``record_while_idle``: leave the decode step graphs to :meth:`idle_work` (a server's
        core is ready sooner; its first decode steps run eagerly), rather than record them now."""
        started = time.perf_counter()
        self.startup = startup.StartupReport()
        runtime = startup.resident_bytes()
        self.registry = registry
        loader, model_path, dtype = self._resolve_model(config)
        self.startup.lap("config")
        self.executor = setup.select_executor(
            self.registry, self.config, self.platform, loader, self.hf_config
        )
        self.connector: KVConnector | None = None  # the KV connector's halves, once built
        self._kv_worker: KVConnector | None = None
        self._structured: StructuredOutputs | None = None  # built at the first structured request
        try:
            self._load_weights(loader, dtype)
            self.startup.lap("weights")
            graph_plan, kv_caches = self._plan_kv_cache(dtype)
            self.startup.lap("KV cache")
            kv_worker = self._build_request_path(kv_caches)
            self._build_runner(kv_caches, kv_worker, dtype, model_path, graph_plan, record_while_idle)
            self.startup.lap("step graphs")
            self.executor.start(self.runner, self.kv_groups)
            if self.config.parallel.tensor_parallel_size > 1:
                self.startup.lap("other ranks")
            self._build_request_features(loader, dtype, kv_caches)
        except BaseException:
            self.shutdown()  # a failed start leaves no worker rank or transfer thread running
            raise
        self._describe_startup(runtime, graph_plan, dtype)
        self._log_ready(time.perf_counter() - started, model_path, dtype)

    def _resolve_model(self, config: EngineConfig):
        """The platform, the checkpoint's loader and config, and :attr:`config` with the model's
        path, dtype and context length resolved; returns (loader, model path, dtype)."""
        self.platform = setup.select_platform(self.registry, config.device)
        self.platform.configure()
        loader, model_path = setup.select_loader(self.registry, config.model.model, config.model.load_format)
        self.hf_config = loader.hf_config()
        self._loader = loader
        apply_hf_overrides(self.hf_config, config.model.hf_overrides, lambda: self.tokenizer)
        # the language model's facts (vocabulary, hidden size, context): a multimodal checkpoint
        # nests them in its text_config, a text-only one is its own text config (as is a
        # loader's config that is no transformers PretrainedConfig)
        text_config = getattr(self.hf_config, "get_text_config", None)
        self.text_config = text_config() if callable(text_config) else self.hf_config
        self.default_sampling_params = generation_config.default_sampling_params(
            config.model.generation_config, loader
        )
        dtype = setup.resolve_dtype(config.model.dtype, self.hf_config, self.platform)
        max_len = setup.resolve_max_model_len(config.model.max_model_len, self.text_config)
        self.config = setup.with_resolved_model(
            config, model=model_path, dtype=str(dtype).removeprefix("torch."), max_model_len=max_len
        )
        torch.manual_seed(self.config.model.seed)
        return loader, model_path, dtype

    def _load_weights(self, loader, dtype: torch.dtype) -> None:
        """The model with its weights (sharded for the executor's ranks), and whether it
        generates or pools."""
        config = self.config
        self.model = setup.build_served_model(
            self.registry, config, loader, self.hf_config, dtype, self.platform, self.executor.tensor_parallel
        )
        setup.calculate_kv_scales(self.model, config)
        self.runner_kind = resolve_runner(config.model.runner, config.model.task, type(self.model).generative)
        self.pooler_config = None
        if self.runner_kind == "pooling":
            self.pooler_config = PoolerConfig.resolve(
                type(self.model).default_pooling_type, config.model.override_pooler_config
            )
            self.config = setup.pooling_config(config)

    def _plan_kv_cache(self, dtype: torch.dtype):
        """Each layer's attention, the step graphs' plan and the KV cache sized in what memory
        is left, allocated; returns (the step graphs' plan, the KV caches)."""
        config, registry = self.config, self.registry
        windows, layer_group = kv_sizing.kv_group_of_layers(self.model.kv_layout())
        layers = setup.layer_attention(
            registry,
            config.attention_backend,
            self.model,
            dtype,
            config.cache.block_size,
            self.platform,
            config.batch_invariant,
            layer_group,
            setup.kv_cache_dtype(config),
        )
        self.attention, self.layer_attention = layers.first, layers
        self.config = config = setup.batch_invariant_config(config, layers.chunk_invariant)
        graph_plan = step_graphs.graph_plan(config, self.platform, layers, self.runner_kind)
        self.kv_groups = groups = kv_sizing.kv_cache_groups(
            config,
            layers,
            windows,
            self.platform,
            step_graphs.graph_memory_estimate(graph_plan, self.text_config, dtype),
        )
        self.num_blocks = num_blocks = groups[0].num_blocks
        max_len = config.model.max_model_len
        self.kv_capacity = kv_sizing.kv_capacity(groups, config.cache.block_size, max_len)
        if self.kv_capacity < max_len:
            raise ValueError(
                f"max_model_len: {max_len} tokens exceed the KV cache's {self.kv_capacity}; "
                "lower max_model_len or raise kv_cache_memory / num_blocks"
            )
        kv_caches = kv_sizing.allocate_kv_caches(layers, groups, self.platform)
        self.config = config = setup.queue_bound_config(config, num_blocks, max_len)
        self.config = setup.state_config(config, layers)
        return graph_plan, kv_caches

    def _build_request_path(self, kv_caches):
        """The KV cache manager, the KV connector and the request lifecycle over them; returns
        the connector's worker half (the runner's)."""
        config = self.config
        self.kv_cache_manager = self._kv_cache_manager(config, self.kv_groups)
        self.connector, self._kv_worker = kv_connectors.build_halves(
            self.registry, config, kv_caches, self.attention.block_dim
        )
        self._kv_counters = kv_connectors.TransferCounters()
        self._kv_meta: object = None  # this step's connector metadata until the runner took it
        self.last_step_computed = False  # False: only transfers were waited on (a loop may pause)
        self.lifecycle = request_path(
            self.registry, config, self.kv_cache_manager, self.connector, config.model.max_model_len
        )
        return self._kv_worker

    def _build_runner(
        self, kv_caches, kv_worker, dtype, model_path: str, graph_plan, record_while_idle: bool
    ):
        """The model runner with its logits processors, adapters, encoder cache and step graphs."""
        config, registry = self.config, self.registry
        processors = [registry.get("logits_processors", name)(config) for name in config.logits_processors]
        self.runner = ModelRunner(
            self.model,
            self.layer_attention,
            kv_caches,
            config.cache.block_size,
            self.platform.device,
            processors,
            kv_worker,
            Pooler(self.pooler_config, self.model.classify) if self.pooler_config else None,
        )
        self.lora = self._lora_manager(config, dtype)
        self.runner.lora = self.lora
        self.mm_processor = self._multimodal_processor(model_path)
        if self.mm_processor is not None:
            self.runner.encoder_cache = EncoderCache(config.multimodal.mm_encoder_cache_bytes)
        max_len = config.model.max_model_len
        self.runner.graphs = step_graphs.start(
            self.model,
            self.attention,
            kv_caches,
            graph_plan,
            -(-max_len // config.cache.block_size),
            self.platform,
            self.text_config.vocab_size,
            max_len,
            self.lora.batch if self.lora is not None else None,
            defer=record_while_idle,
        )

    def _build_request_features(self, loader, dtype, kv_caches) -> None:
        """What requests may ask for beyond plain generation: sleep mode, a drafter, grammars,
        reasoning markers; and the step histogram and end-of-sequence id."""
        config = self.config
        self._sleep: SleepMode | None = None  # rank 0's, built at the first sleep or weight update
        if config.enable_sleep_mode:
            setup.check_sleep_mode(self.executor, self.platform, self.connector)
        self.speculator = self._build_speculator(config, loader, dtype, kv_caches, self.num_blocks)
        self.grammar_backend = self._grammar_backend(config.structured_outputs_backend)
        if config.reasoning_parser is not None:  # a name no plugin registers stops the engine now
            self.registry.registration("reasoning_parsers", config.reasoning_parser)
        if self.speculator is not None:
            self.startup.lap("drafter")
        self._step_tokens = StepTokenHistogram()
        self.eos_token_id = self._eos_token_id()

    def _log_ready(self, seconds: float, model_path: str, dtype) -> None:
        config = self.config
        logger.info(
            "engine ready in %.1fs: %s (%s) on %s, %s, attention=%s, KV cache %s: %d tokens "
            "(%d blocks of %d tokens, %d bytes per token), determinism=%s",
            seconds,
            model_path,
            self.model.implementation,
            self.platform.name,
            dtype,
            self.attention.name,
            kv_dtype_name(self.attention.spec.cache_dtype),
            self.kv_capacity,
            self.num_blocks,
            config.cache.block_size,
            kv_sizing.kv_bytes_per_token(self.layer_attention, config.cache.block_size),
            self.determinism(),
        )
        if self.default_sampling_params:
            logger.warning(
                "default sampling parameters from the model's generation config (%s): %s; "
                "relaunch with --generation-config vllm to ignore them",
                config.model.generation_config,
                self.default_sampling_params,
            )

    def _describe_startup(self, runtime: int, graph_plan, dtype) -> None:
        """The parts chosen and the memory by use in :attr:`startup` (the front ends print it)."""
        report, model, config = self.startup, self.model, self.config
        layers, groups = self.layer_attention, self.kv_groups
        startup.describe(
            report,
            self.platform,
            model.implementation,
            model.ctx.linear_method,
            layers,
            graph_plan,
            config,
            self.hf_config,
            dtype,
        )
        if self.has_idle_work():
            report.parts["step graphs"] += ", recorded while idle"
        graph_bytes = step_graphs.graph_memory_estimate(graph_plan, self.hf_config, dtype)
        weights = startup.tensor_bytes(t for _, t in named_tensors(model))
        startup.describe_memory(
            report, weights, groups, layers, graph_bytes, config, self.hf_config, dtype, runtime
        )
        report.notes.extend(self.platform.layer_ops(dtype).notes(model))
        resident = startup.resident_bytes() / 2**20
        report.notes.append(
            f"resident now {resident:.0f} MiB; the KV cache's pages become resident as it fills"
        )

    def _kv_cache_manager(self, config, groups):
        cls = self.registry.get("kv_cache_managers", config.scheduler.kv_cache_manager)
        if len(groups) == 1 and groups[0].sliding_window is None and not groups[0].state:
            return cls(config, groups[0].num_blocks)
        if any(g.state for g in groups):
            return self._state_kv_cache_manager(cls, config, groups)
        if not cls.supports_groups:
            raise ValueError(
                f"kv_cache_manager: {config.scheduler.kv_cache_manager!r} cannot hold KV cache "
                "groups, which this model's sliding-window layers need"
            )
        if kv_connectors.connector_spec(config) is not None:
            raise ValueError("kv_connector: not supported for a model with sliding-window layers")
        return cls(config, groups[0].num_blocks, groups=groups)

    def _state_kv_cache_manager(self, cls, config, groups):
        """The manager of a model with state layers (Mamba2), refused where it cannot work."""
        name = config.scheduler.kv_cache_manager
        if not (cls.supports_groups and getattr(cls, "supports_state", False)):
            raise ValueError(
                f"kv_cache_manager: {name!r} cannot hold state groups (one slot per request), "
                "which this model's Mamba layers need"
            )
        if kv_connectors.connector_spec(config) is not None:
            raise ValueError("kv_connector: not supported for a model with Mamba (state) layers")
        return cls(config, groups[0].num_blocks, groups=groups)

    def _multimodal_processor(self, model_path: str) -> MultiModalProcessor | None:
        """The model's image processor (None for a text-only model): the front end turns a
        prompt's images into tensors and placeholder spans with it."""
        processor_class = type(self.model).multimodal_processor
        if processor_class is None or self.no_images_reason() is not None:
            return None
        return build_processor(
            processor_class, model_path, self.hf_config, self.config.multimodal.mm_processor_kwargs
        )

    def no_images_reason(self) -> str | None:
        """Why this engine takes no images (None: it takes them)."""
        return no_images_reason(type(self.model), self.config.multimodal.limit_mm_per_prompt)

    def _lora_manager(self, config, dtype) -> LoRAManager | None:
        """The adapters' slots on rank 0's model (each worker rank builds its own), when
        ``enable_lora``; the pooling runner is refused here, at start."""
        if not config.lora.enable_lora:
            return None
        if self.runner_kind == "pooling":
            raise ValueError("enable_lora: LoRA adapters do not run with the pooling runner yet")
        ops = self.platform.layer_ops(dtype)
        return LoRAManager(self.model, config.lora, dtype, self.platform.device, ops)

    def _build_speculator(self, config, loader, dtype, kv_caches, num_blocks) -> Speculator | None:
        if not config.speculative_config:
            return None
        spec = dict(config.speculative_config)
        if self.layer_attention.has_state:
            raise ValueError(
                "speculative_config: not supported for a model with Mamba (state) layers: a "
                "rejected draft would stay in the per-request state"
            )
        if not self.layer_attention.uniform:
            raise ValueError(
                "speculative_config: not supported for a model whose layers attend in several ways "
                "(sliding-window or per-layer attention kinds)"
            )
        drafter_cls = self.registry.get("drafters", spec.get("method"))
        # a drafter that calls the target's sharded layers drafts on every rank, in step
        executor = self.executor if getattr(drafter_cls, "drafts_on_every_rank", False) else None
        ctx = setup.drafter_context(
            self.registry,
            config,
            self.platform,
            dtype,
            loader,
            self.hf_config,
            (self.model, self.attention, kv_caches, num_blocks),
            self.tokenizer,
            executor.share if executor is not None else None,
        )
        drafter = drafter_cls(ctx)
        call = functools.partial(executor.drafter_call, drafter) if executor is not None else None
        self.runner.keep_hidden_states = drafter.needs_hidden_states
        self.runner.hidden_layers = tuple(drafter.hidden_state_layers() or ())
        return Speculator(
            drafter,
            int(spec.get("num_speculative_tokens", 4)),
            self.kv_cache_manager,
            self.max_model_len,
            call,
        )

    @functools.cached_property
    def tokenizer(self):
        """The checkpoint's tokenizer (None: it has none), loaded at first use: grammars, a
        drafter, an end-of-sequence id the config lacks. A served core's requests arrive as
        token ids, so most cores need it late or never, and start-up goes without it."""
        return self._loader.tokenizer()

    def _grammar_backend(self, name: str | None) -> str | None:
        """The grammar backend structured requests will use: the one named (checked now, so a
        refused or missing one stops the engine at start), ``auto`` (every installed one, see
        :mod:`engine.core.structured`; None when there is none), else the registry's default."""
        if name is None:
            return self.registry.default("grammar_backends")
        if name == AUTO_GRAMMAR:
            return AUTO_GRAMMAR if self.registry.names("grammar_backends") else None
        self.registry.registration("grammar_backends", name)
        return name

    def _grammar_backends(self) -> dict[str, type]:
        """Name -> class of the backends to try, in order: for ``auto``, every installed one by
        the registry's preference (the default first, as :meth:`PluginRegistry.default` ranks)."""
        if self.grammar_backend != AUTO_GRAMMAR:
            names = [self.grammar_backend]
        else:
            names = self.registry.by_preference("grammar_backends")
            logger.info("structured outputs: backend auto tries %s in this order", ", ".join(names))
        return {name: self.registry.get("grammar_backends", name) for name in names}

    def _eos_token_id(self) -> int | None:
        eos = getattr(self.text_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return eos

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    def determinism(self) -> str:
        """The guarantee in force for temperature-0 output (``/v1/models``' ``determinism``):

        - ``"batch-invariant"`` (``--batch-invariant``): a request's tokens and log-probs are
          bit for bit the same alone, batched with any others, under speculation, cold or from
          the prefix cache, whole or chunked;
        - ``"chunk-invariant"``: every attention backend declares ``chunk_invariant``, so a
          row's attention does not depend on the prefix cache or the chunking; the linear
          layers are the quant method's kernels, whose sums may still depend on how many rows
          share a call (bf16 GEMMs do, the int8 kernel of the default model on the cpu-native
          platform does not: there repeats agree, cached, chunked and batched alike, on AMX
          with its tiles off);
        - ``"none"``: an attention backend in use promises neither."""
        if self.config.batch_invariant:
            return "batch-invariant"
        return "chunk-invariant" if self.layer_attention.chunk_invariant else "none"

    @property
    def embedding_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def classifier_labels(self) -> list[str]:
        """A classifier's labels in logit order (its config's ``id2label``); empty for any other model."""
        names = getattr(self.text_config, "id2label", None) or {}
        return [str(names.get(i, f"LABEL_{i}")) for i in range(self.model.num_labels)]

    def validate(
        self,
        prompt_token_ids: list[int],
        params,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        mm_items: tuple[MultiModalItem, ...] = (),
    ) -> None:
        """Raise ValueError naming the field before any work is queued. With
        ``SamplingParams``' own checks this covers everything the step indexes with: a
        request that passes cannot make the sampler raise. ``PoolingParams`` are for an
        engine with the pooling runner, ``SamplingParams`` for one that generates. A
        ``lora_request``'s adapter is read and checked here (then kept loaded)."""
        check_int64(priority, "priority")
        if lora_request is not None:
            self._check_lora(lora_request)
        if mm_items:
            check_mm_items(
                mm_items,
                len(prompt_token_ids),
                self.no_images_reason(),
                self.config.multimodal.limit_mm_per_prompt,
            )
        vocab = self.text_config.vocab_size
        if isinstance(params, PoolingParams):
            if self.runner_kind != "pooling":
                raise InvalidParam(
                    "pooling_params",
                    "pooling_params: this engine generates (runner='generate'); "
                    "start it with runner='pooling' to embed",
                )
            check_prompt(prompt_token_ids, vocab, self.max_model_len, generates=False)
            if params.task == "classify" and not self.model.num_labels:
                raise InvalidParam(
                    "task",
                    f"task: {type(self.model).__name__} has no classification head; "
                    "classify and score need a sequence-classification model",
                )
            params.check_dimensions(self.embedding_size, *matryoshka_of(self.text_config))
            return
        if not isinstance(params, SamplingParams):
            raise InvalidParam(
                "sampling_params", f"sampling_params must be SamplingParams, got {type(params)}"
            )
        if self.runner_kind == "pooling":
            raise InvalidParam(
                "sampling_params",
                "sampling_params: this engine pools (runner='pooling') and generates nothing; embed instead",
            )
        check_prompt(prompt_token_ids, vocab, self.max_model_len)
        params.check_vocab(vocab)
        if params.bad_words and not params.bad_words_token_ids:
            raise InvalidParam(
                "bad_words", "bad_words: not tokenized (the front end calls tokenize_bad_words)"
            )
        if params.structured_outputs is not None and self.grammar_backend is None:
            raise InvalidParam(
                "structured_outputs", "structured_outputs: no grammar backend plugin is installed"
            )

    def _check_lora(self, lora_request) -> None:
        if not isinstance(lora_request, LoRARequest):
            raise InvalidParam(
                "lora_request", f"lora_request must be a LoRARequest, got {type(lora_request).__name__}"
            )
        if self.lora is None:
            raise InvalidParam(
                "lora_request", "lora_request: LoRA is not enabled; start the engine with enable_lora=True"
            )
        self.lora.load(lora_request)

    def add_request(self, request: Request) -> None:
        if self.is_sleeping():
            raise Asleep("the engine is asleep: wake it up first (POST /wake_up)")
        self.validate(
            request.prompt_token_ids,
            request.pooling_params or request.sampling_params,
            request.priority,
            request.lora_request,
            request.mm_items,
        )
        request.eos_token_id = self.eos_token_id if request.eos_token_id is None else request.eos_token_id
        request.queued_time = time.monotonic()
        self.lifecycle.add(request)  # the scheduler may refuse it: Overloaded
        if request.pooling_params is None and request.sampling_params.structured_outputs is not None:
            self.structured.submit(request)

    @property
    def structured(self) -> StructuredOutputs:
        if self._structured is None:
            backends = self._grammar_backends()
            apis = {name: self.registry.registration("grammar_backends", name).api for name in backends}
            self._structured = StructuredOutputs(
                backends,
                GrammarContext(self.tokenizer, self.text_config.vocab_size),
                apis,
                reasoning_markers(self.registry, self.config, self.tokenizer),
            )
        return self._structured

    def abort(self, request_ids) -> None:
        self.lifecycle.abort(request_ids)
        if self.speculator is not None:
            self.speculator.finished(request_ids)

    def has_unfinished(self) -> bool:
        return self.lifecycle.has_unfinished()

    def has_pending_transfers(self) -> bool:
        """Finished requests hold blocks until the KV connector reports them sent: the engine
        must keep stepping (the worker half's report is read each step) even without requests."""
        return self.lifecycle.has_pending_transfers()

    def step(self) -> list[EngineOutput]:
        outputs = self._structured.poll(self.lifecycle) if self._structured else []
        plan = self.lifecycle.schedule()
        self.last_step_computed = bool(plan.scheduled)
        if plan.refused:
            outputs += self._refused(plan.refused)
        if self.connector is not None:
            self._kv_meta = self.connector.build_connector_meta(plan)
        if not plan.scheduled:
            if self.connector is not None:
                self.runner.transfer_kv(self._kv_meta)
                self._collect_kv_transfers()
            return outputs
        if self.runner.runs_bursts_of(len(plan.scheduled)):
            plan = self.lifecycle.with_burst(plan, self.config.scheduler.num_scheduler_steps)
        self._mark_scheduled(plan)
        try:
            result = self._execute(plan)
        except ExecutorFailure:
            raise  # the ranks are out of step: nothing to isolate
        except Exception as error:  # attributed to a request, or re-raised: fatal
            if self.layer_attention.has_state:
                raise  # the failed run may have advanced Mamba states in place: a re-run would not repeat it
            plan, result, failed = self._isolate(plan, error)
            outputs += failed
        if self.connector is not None:
            self._collect_kv_transfers()
        if self.speculator is not None:
            self.speculator.record(plan, result)
        outputs += self._time_first_tokens(plan, self.lifecycle.apply(plan, result))
        if self.speculator is not None:
            self.speculator.finished([o.request_id for o in outputs if o.finished] + list(plan.preempted))
            self.speculator.propose(self.lifecycle.running(plan), result, self.lifecycle.reserve_lookahead)
        return outputs

    def _mark_scheduled(self, plan: StepPlan) -> None:
        """Stamp first scheduling and count the step's tokens (one attribute test per request)."""
        now = time.monotonic()
        for item in plan.scheduled:
            if item.request.scheduled_time is None:
                item.request.scheduled_time = now
        self._step_tokens.observe(plan.num_tokens)

    def _time_first_tokens(self, plan: StepPlan, outputs: list[EngineOutput]) -> list[EngineOutput]:
        """Attach :class:`RequestTiming` to each request's first output that carries tokens."""
        pending = {
            i.request.request_id: i.request for i in plan.scheduled if i.request.first_token_time is None
        }
        if not pending:
            return outputs
        now = time.monotonic()
        for index, out in enumerate(outputs):
            request = pending.get(out.request_id)
            if request is None or not out.new_token_ids:
                continue
            request.first_token_time = now
            timing = RequestTiming(
                queue=request.scheduled_time - request.queued_time, prefill=now - request.scheduled_time
            )
            outputs[index] = attrs.evolve(out, timing=timing)
        return outputs

    def _refused(self, request_ids) -> list[EngineOutput]:
        wait = self.config.scheduler.max_queue_wait
        message = f"overloaded: not scheduled within {wait:g} s (max_queue_wait); retry later"
        return [
            EngineOutput(rid, [], finish_reason="error", error=message, error_code=OVERLOADED)
            for rid in request_ids
        ]

    def _execute(self, plan: StepPlan, block_tables: list[list[int]] | None = None) -> StepResult:
        """``block_tables``: one table per request, the same in every KV cache group (the fault
        probe's); None: the KV cache manager's."""
        if block_tables is None:
            per_request = [self.kv_cache_manager.group_block_ids(item.request) for item in plan.scheduled]
            group_tables = [list(tables) for tables in zip(*per_request)]
        else:
            group_tables = [block_tables] * len(self.kv_groups)
        bitmask = self._structured.bitmask(plan) if self._structured else None
        kv_meta, self._kv_meta = self._kv_meta, None  # a re-run to isolate a fault transfers nothing again
        return self.executor.execute(plan, group_tables, bitmask, kv_meta)

    def _collect_kv_transfers(self) -> None:
        """The worker half's report of the step, to the counters, the scheduler half and the lifecycle."""
        report = self.runner.connector.get_finished()
        self._kv_counters.add(report)
        self.connector.update_connector_output(report)
        self.lifecycle.on_kv_report(report)

    def _isolate(self, plan: StepPlan, error: Exception) -> tuple[StepPlan, StepResult, list[EngineOutput]]:
        """Re-run the failed step's requests one by one; finish the ones that fail alone
        with an error (see :mod:`engine.core.faults`)."""
        isolated = faults.isolate(plan, self._execute, error)
        failed = []
        for request, exc in isolated.culprits:
            logger.error(
                "request %s failed in the engine step; finishing it with an error",
                request.request_id,
                exc_info=exc,
            )
            self.lifecycle.abort([request.request_id], "error")
            failed.append(
                EngineOutput(request.request_id, [], finish_reason="error", error=faults.error_message(exc))
            )
        return isolated.plan, isolated.result, failed

    def take_kv_events(self) -> list:
        """The prefix cache's KV events since the last call (with ``kv_events_config``)."""
        return self.kv_cache_manager.take_events()

    def stats(self) -> dict:
        spec = self.speculator.stats() if self.speculator is not None else {}
        kv = self._kv_counters.stats() if self.connector is not None else {}
        return {
            **self.lifecycle.stats(),
            **spec,
            **self._step_tokens.stats(),
            **kv,
            **self._encoder_stats(),
        }

    def _encoder_stats(self) -> dict:
        """A multimodal model's encoder counters (none for a text-only one)."""
        encoder = self.runner.encoder_cache
        if encoder is None:
            return {}
        return {"mm_encoder_runs": encoder.encoder_runs, "mm_encoder_cache_hits": encoder.hits}

    def cache_info(self) -> dict[str, str]:
        """The KV cache's configuration as strings (vLLM's ``cache_config_info`` labels)."""
        cache = self.config.cache
        return {
            "block_size": str(cache.block_size),
            "num_gpu_blocks": str(self.num_blocks),
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "cache_dtype": self.config.model.dtype,
            "gpu_memory_utilization": str(cache.memory_utilization),
            "kv_cache_memory_bytes": str(cache.kv_cache_memory),
            "kv_cache_manager": self.config.scheduler.kv_cache_manager,
        }

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``/reset_prefix_cache``); False while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def sleep(self, level: int = 1) -> int:
        """Give the KV cache back, and the weights by ``level`` (:mod:`engine.core.sleep`), on
        every rank, until :meth:`wake_up`; requests meanwhile are refused as overloaded. Returns
        the bytes released (all ranks). A KV connector's stored blocks stay valid (waking restores
        the same weights): its pending saves are carried out first, while the pool holds them."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep: the engine was started without enable_sleep_mode (--enable-sleep-mode)")
        if level == 2 and self.lora is not None:
            raise ValueError("sleep: level 2 would discard the LoRA adapters' slots; use level 1")
        self._require_idle("sleep")
        self._flush_kv_transfers()
        self.reset_prefix_cache()
        return sum(self._on_every_rank("sleep", level))

    def wake_up(self) -> None:
        if self._sleep is not None:
            self._on_every_rank("wake_up")

    def is_sleeping(self) -> bool:
        return self._sleep is not None and self._sleep.level > 0

    def has_idle_work(self) -> bool:
        """Whether start-up left work to :meth:`idle_work` (not while asleep: the weights
        may be gone)."""
        graphs = self.runner.graphs
        return graphs is not None and bool(graphs.idle_pending) and not self.is_sleeping()

    def idle_work(self) -> None:
        """Record one more decode step graph (``record_while_idle``), a fraction of a second;
        call it between steps while no request waits. A recording that fails leaves decode
        eager, as at start-up."""
        graphs = self.runner.graphs
        if not self.has_idle_work():
            return
        try:
            graphs.record_next()
        except RuntimeError as exc:
            logger.info("decode steps run eagerly: recording %s failed: %s", graphs.recorder.name, exc)
            self.runner.graphs = None

    def update_weights_from_disk(self, model_path: str) -> None:
        """Load the weights of the checkpoint at ``model_path`` in place, each rank its share
        (SGLang's call; an RL trainer's sync). The architecture must match; the prefix cache and
        a KV connector's stored blocks are forgotten."""
        self._update_weights("update_weights_from_disk", "prepare_checkpoint", model_path)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> None:
        """Join a trainer's ``torch.distributed`` group, tensor-parallel rank ``r`` as rank
        ``rank_offset + r`` (SGLang's call: :mod:`engine.core.weight_sync`); waits for the
        trainer, at most ``distributed_timeout``."""
        setup.check_in_place("init_weights_update_group", self.executor, self.connector)
        sleep_mode = self._sleep_mode()
        if sleep_mode.group is not None:
            raise ValueError("init_weights_update_group: a group is open; destroy_weights_update_group first")
        weight_sync.check_place(backend, rank_offset, world_size, self.config.parallel.tensor_parallel_size)
        loader, _ = setup.select_loader(self.registry, sleep_mode.checkpoint, self.config.model.load_format)
        if loader.quant_config():
            raise ValueError(
                "init_weights_update_group: the served checkpoint is quantized; a trainer's float "
                "tensors cannot replace its blocks (serve a float checkpoint, quantized at load if need be)"
            )
        timeout = datetime.timedelta(seconds=self.config.parallel.distributed_timeout)
        self._on_every_rank(
            "join_group", master_address, master_port, rank_offset, world_size, group_name, backend, timeout
        )

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> None:
        """Receive ``names`` from the trainer (its broadcasts, in this order, on every rank) and
        serve the checkpoint with them in place of its own tensors; the prefix cache and a KV
        connector's stored blocks are forgotten."""
        if self._sleep is None or self._sleep.group is None:
            raise ValueError("update_weights_from_distributed: no group; init_weights_update_group first")
        self._update_weights("update_weights_from_distributed", "receive", names, dtypes, shapes)

    def destroy_weights_update_group(self) -> None:
        if self._sleep is not None:
            self._on_every_rank("leave_group")

    def _update_weights(self, what: str, prepare: str, *args) -> None:
        """Every rank builds its share of the new weights (``prepare``); once all have, each copies
        them in, else none does. The KV connector forgets its blocks first, so none the old
        weights computed can outlive the change (a failed update then costs only that cache)."""
        setup.check_in_place(what, self.executor, self.connector)
        self._require_idle(what)
        if self.connector is not None:
            kv_connectors.forget_blocks(self.connector, what)
        try:
            self._on_every_rank(prepare, *args)
        except ValueError:
            self._on_every_rank("abort")
            raise
        self._on_every_rank("commit")
        self.reset_prefix_cache()

    def _require_idle(self, what: str) -> None:
        if self.has_unfinished() or self.has_pending_transfers():
            raise ValueError(f"{what}: requests are in flight; wait for them to finish")

    def _flush_kv_transfers(self) -> None:
        """Carry out what the KV connector ordered since the last step (saves of finished
        requests' blocks), in a step that computes nothing."""
        if self.connector is not None:
            self.runner.transfer_kv(self.connector.build_connector_meta(StepPlan(())))
            self._collect_kv_transfers()

    def _on_every_rank(self, name: str, *args) -> list:
        return self.executor.sleep_mode_call(self._sleep_mode(), name, *args)

    def _sleep_mode(self) -> SleepMode:
        if self._sleep is None:
            self._sleep = setup.sleep_mode(
                self.registry,
                self.config,
                self.platform,
                self.model,
                self.runner.kv_caches,
                self.executor.tensor_parallel,
            )
        return self._sleep

    def check_health(self) -> None:
        """Raise :class:`engine.interfaces.ExecutorFailure` if a tensor-parallel rank is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self._structured is not None:
            self._structured.shutdown()
        if self.connector is not None and self._kv_worker is not None:
            self.connector.shutdown()
            self._kv_worker.shutdown()
