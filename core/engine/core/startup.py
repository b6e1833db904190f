"""The start-up summary: what the engine chose, where its memory goes and where the start-up
seconds went, on one screen. :class:`EngineCore` fills a :class:`StartupReport` as it starts (the
front ends print it); :func:`plan` makes the same report without loading weights or allocating
the KV cache (``engine serve --dry-run``): the model is built on the ``meta`` device, which gives
its KV layout and the size of every weight a quant method makes at construction."""

from __future__ import annotations

import glob
import os
import time

import attrs
import torch

from engine.core import kv_sizing, setup
from engine.core.sleep import named_tensors
from engine.interfaces.model import ModelContext
from engine.layers import Linear
from engine.runner import step_graphs

MiB = 2**20


@attrs.define
class StartupReport:
    parts: dict[str, str] = attrs.Factory(dict)  # what was chosen, e.g. "model": "LlamaForCausalLM"
    memory: dict[str, int] = attrs.Factory(dict)  # bytes by use: weights, KV cache, ...
    phases: list[tuple[str, float]] = attrs.Factory(list)  # (phase, seconds), in order
    notes: list[str] = attrs.Factory(list)  # e.g. the KV cache's tokens, why no step graphs
    _last: float = attrs.field(factory=time.perf_counter, repr=False)

    def lap(self, phase: str) -> None:
        """``phase`` took the time since the previous lap (or since the report was made)."""
        now = time.perf_counter()
        self.phases.append((phase, now - self._last))
        self._last = now

    def render(self, title: str = "engine start-up") -> str:
        seconds = sum(s for _, s in self.phases)
        total = sum(self.memory.values())
        lines = [f"{title} ({seconds:.1f} s):"]
        lines.append("  parts   " + " · ".join(f"{k} {v}" for k, v in self.parts.items()))
        memory = " · ".join(f"{k} {_size(v)}" for k, v in self.memory.items())
        lines.append(f"  memory  {memory} · total {_size(total)}")
        if self.phases:
            lines.append("  time    " + " · ".join(f"{name} {s:.1f} s" for name, s in self.phases))
        lines += [f"  note    {note}" for note in self.notes]
        return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / MiB:.1f} MiB"


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (views share one); an opaque tensor
    (oneDNN's prepacked weight: no storage to share) counts its elements."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.is_mkldnn:
            seen[id(t)] = t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def activation_bytes(config, hf_config, dtype: torch.dtype) -> int:
    """A generous bound on one eager step's activations: per token in the step budget the
    projections' outputs (q|k|v, attention, residual, gate|up, its product), and per sequence
    float32 logits and probabilities."""
    hidden = getattr(hf_config, "hidden_size", 0)
    intermediate = getattr(hf_config, "intermediate_size", None) or 4 * hidden
    tokens, seqs = config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs
    per_token = (6 * hidden + 3 * intermediate) * dtype.itemsize
    return tokens * per_token + seqs * getattr(hf_config, "vocab_size", 0) * 4 * 2


def resident_bytes() -> int:
    """This process's resident memory now (0 where the system does not say)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class _AfterLoading:
    """The platform as it will be once the weights are loaded: ``weights`` bytes less free."""

    def __init__(self, platform, weights: int):
        self._platform, self._weights = platform, weights

    def __getattr__(self, name):
        return getattr(self._platform, name)

    def free_memory(self) -> int:
        return self._platform.free_memory() - self._weights

    def memory_in_use(self) -> tuple[int, int]:
        used, total = self._platform.memory_in_use()
        return used + self._weights, total


def plan(config, registry) -> StartupReport:
    """The start-up report of an engine for ``config``, without loading its weights."""
    report = StartupReport()
    runtime = resident_bytes()
    platform = setup.select_platform(registry, config.device)
    loader, path = setup.select_loader(registry, config.model.model, config.model.load_format)
    hf_config = loader.hf_config()
    dtype = setup.resolve_dtype(config.model.dtype, hf_config, platform)
    max_len = setup.resolve_max_model_len(config.model.max_model_len, hf_config)
    config = setup.with_resolved_model(config, model=path, dtype=str(dtype).removeprefix("torch."))
    cls, implementation = setup.choose_model_class(registry, hf_config, config.model.model_impl)
    checkpoint = loader.quant_config()
    method = setup.select_quant_method(
        registry, config.model.quantization, checkpoint, dtype, platform, config.batch_invariant
    )
    with torch.device("meta"):
        context = ModelContext(
            hf_config,
            dtype,
            torch.device("meta"),
            method,
            platform.layer_ops(dtype),
            config.multimodal.limit_mm_per_prompt,
        )
        model = cls(context)
    weights = _planned_weights(model, path)
    windows, layer_group = kv_sizing.kv_group_of_layers(model.kv_layout())
    layers = setup.layer_attention(
        registry,
        config.attention_backend,
        model,
        dtype,
        config.cache.block_size,
        platform,
        config.batch_invariant,
        layer_group,
        setup.kv_cache_dtype(config),
    )
    graphs = step_graphs.graph_plan(config, platform, layers, "generate")
    graph_bytes = step_graphs.graph_memory_estimate(graphs, hf_config, dtype)
    groups = kv_sizing.kv_cache_groups(config, layers, windows, _AfterLoading(platform, weights), graph_bytes)
    report.lap("plan")
    describe(report, platform, implementation, method, layers, graphs, config, hf_config, dtype)
    describe_memory(report, weights, groups, layers, graph_bytes, config, hf_config, dtype, runtime)
    report.notes.append(f"max_model_len {max_len}")
    return report


def _planned_weights(model, path: str) -> int:
    """The meta model's tensors (buffers too: rotary tables), and each linear layer whose quant
    method makes its kernel at load from tensors fed through sinks (AWQ, GPTQ, bitsandbytes) at
    its ``planned_kernel``; a method that makes every weight only at load (GGUF blocks, whose
    shapes the file says) is planned at the checkpoint's size instead."""
    built = tensor_bytes(t for _, t in named_tensors(model)) + _planned_kernels(model)
    files = [path] if os.path.isfile(path) else glob.glob(os.path.join(path, "*.safetensors"))
    on_disk = sum(os.path.getsize(f) for f in files)
    return built if built >= on_disk // 10 else on_disk


def _planned_kernels(model) -> int:
    """Bytes of the kernels the quant methods plan for their sink-fed linear layers
    (``QuantMethod.planned_kernel``), each shape built once on the CPU."""
    sizes: dict[tuple, int] = {}
    total = 0
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        key = (id(module.method), module.input_size, tuple(module.output_sizes))
        if key not in sizes:
            planned = getattr(module.method, "planned_kernel", None)  # None: not a QuantMethod
            with torch.device("cpu"):
                kernel = planned and planned(module.input_size, list(module.output_sizes))
            sizes[key] = 0 if kernel is None else tensor_bytes(t for _, t in named_tensors(kernel))
        total += sizes[key]
    return total


def describe(report, platform, implementation: str, method, layers, graphs, config, hf_config, dtype) -> None:
    """``implementation``: which model runs, in words (:func:`engine.core.setup.choose_model_class`)."""
    backends = ", ".join(dict.fromkeys(b.name for b in layers.backends))
    report.parts.update(
        platform=platform.name,
        model=implementation,
        dtype=str(dtype).removeprefix("torch."),
        weights=getattr(type(method), "name", type(method).__name__),
        attention=backends,
        kv_dtype=str(layers.first.spec.cache_dtype).removeprefix("torch."),
    )
    if layers.has_state:
        report.notes.append(setup.STATE_NO_PREFIX_CACHING)
    if graphs.sizes:
        sizes = graphs.sizes
        report.parts["step graphs"] = f"{graphs.graphs.name} for {sizes[0]}..{sizes[-1]} sequences"
        if (steps := config.scheduler.num_scheduler_steps) > 1:
            report.notes.append(
                f"greedy decode runs up to {steps} steps a scheduling pass (num_scheduler_steps)"
            )
    else:
        report.notes.append("decode steps run eagerly: " + "; ".join(graphs.reasons))


def describe_memory(report, weights, groups, layers, graph_bytes, config, hf_config, dtype, runtime) -> None:
    kv = sum(g.num_blocks * sum(kv_sizing.layer_block_bytes(layers, i) for i in g.layers) for g in groups)
    block_size = config.cache.block_size
    report.memory.update(
        runtime=runtime,
        weights=weights,
        kv_cache=kv,
        step_graphs=graph_bytes,
        activations=activation_bytes(config, hf_config, dtype),
    )
    paged = [g for g in groups if not g.state]
    if paged:
        tokens = (paged[0].num_blocks - 1) * block_size
        report.notes.append(f"KV cache: {tokens} tokens ({paged[0].num_blocks} blocks of {block_size})")
    for group in groups:
        if group.state:
            report.notes.append(
                f"Mamba state: {group.num_blocks - 1} slots of "
                f"{kv_sizing.state_bytes_per_request(layers)} bytes (one per running request)"
            )
