"""Attention backend: the paged KV cache layout and the attention kernel.

Per step the runner builds one :class:`BatchLayout` over the ragged batch (requests
in scheduling order, their query tokens flattened into one axis, no padding); the
backend turns it into its own metadata once (``build_metadata``), then every layer
calls ``forward``, which writes this step's K/V into the paged cache through
``slot_mapping`` and attends over each request's blocks. Prefill, decode and mixed
batches arrive in one call; a request's query tokens are the last ``query_len``
positions of its ``seq_len`` context (causal within the chunk, unless ``AttentionSpec.causal``
is False: then every query row attends to the whole context).

Interface v4 made the spec's attention kinds (``sliding_window``, ``logit_softcap``,
``query_scale``, ``causal=False``) part of the contract, and constructs a backend with the
engine's plugin registry (``registry=``). The engine never hands a backend registered for an
older version a spec that asks for one of them (:func:`spec_for_version`): it would ignore it.
``chunk_invariant`` is a declaration with a default ("not promised"), so it bumped nothing.

A quantized KV cache (``AttentionSpec.kv_cache_dtype``: vLLM's ``--kv-cache-dtype fp8``) is
a declaration with a default too: a backend lists the cache dtypes it reads beside the activation
dtype in ``kv_cache_dtypes`` (default none, so an older backend is read as "activation dtype
only" and never handed such a spec). Stored values are ``x / scale`` saturated to the dtype's
finite range and rounded to nearest (:func:`quantize_kv`); a backend reads ``stored · scale``
(:func:`dequantize_kv`), the layer's per-tensor :class:`KVScale` handed to ``forward`` as
``kv_scale=`` when the cache is quantized.

Interface v5 added cache layouts beyond per-head K/V. A spec with ``latent`` set
(:class:`PagedLatent`: MLA's one ``kv_lora_rank + rope_dim`` vector per token, no separate V)
asks the paged latent layout; a backend lists the layouts it reads in ``cache_layouts`` (default:
per-head K/V only) and attends over latent pages in ``forward_latent``, handed the layer's
up-projection (:class:`LatentUpProjection`). Older backends are never handed a latent spec.

Interface v6 added attention sinks (``AttentionSpec.sinks``: gpt-oss): each head has a learned
logit that joins the softmax's denominator only, so a row's weights sum to less than one; the
layer's values, one per query head, reach ``forward`` as ``sinks=``. Older backends are never
handed a spec with sinks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch

from engine.interfaces.platform import Platform

# the cache layouts a backend may read (``AttentionBackend.cache_layouts``)
PAGED_KV = "paged-kv"  # per-head K and V of every token, in blocks
PAGED_LATENT = "paged-latent"  # one compressed vector per token, in blocks (MLA)


@attrs.frozen
class PagedLatent:
    """The paged latent layout of a multi-head latent attention (MLA) layer: per token one
    vector, the normalized KV latent (``kv_lora_rank``) followed by the rotated key part shared
    by every head (``rope_dim``); keys and values of each head are up-projections of it."""

    kv_lora_rank: int
    rope_dim: int

    @property
    def entry_dim(self) -> int:
        """Cache elements per token and layer."""
        return self.kv_lora_rank + self.rope_dim


@attrs.frozen
class LatentUpProjection:
    """A latent layer's per-head up-projections (``kv_b_proj`` split): a head's key without
    rotary part is ``key @ latent`` and its value ``value @ latent``."""

    key: torch.Tensor  # [H, qk_nope_head_dim, kv_lora_rank]
    value: torch.Tensor  # [H, v_head_dim, kv_lora_rank]


@attrs.frozen
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    # EngineConfig.batch_invariant: each query row attended alone over its own context, the
    # same way whether it decodes, verifies a draft or shares the step with any other rows
    # (a first prefill chunk that is the whole prompt may still go through a causal kernel)
    batch_invariant: bool = False
    # a query at position p attends keys at positions > p - sliding_window (itself included:
    # ``sliding_window`` keys at most), as Hugging Face's Mistral and Gemma masks do; None: all
    sliding_window: int | None = None
    # attention logits soft-capped as cap * tanh(logits / cap) after scaling (Gemma 2); None: not
    logit_softcap: float | None = None
    # the query scale; None: head_dim ** -0.5 (Gemma sets query_pre_attn_scalar ** -0.5)
    query_scale: float | None = None
    # False: bidirectional, each query row attends to every position of its context (encoder-only
    # models such as BERT, whose pooling requests run their whole prompt in one step); a backend
    # that cannot do this lists it in ``supports``
    causal: bool = True
    # the KV cache's storage dtype when it differs from ``dtype`` (a quantized cache, one of
    # :data:`KV_CACHE_DTYPES`' values); None: the activation dtype. Only a backend listing it in
    # ``kv_cache_dtypes`` is handed such a spec.
    kv_cache_dtype: torch.dtype | None = None
    # (interface v5) the paged latent layout (MLA); None: per-head K/V. ``num_kv_heads`` is then 1
    # and ``head_dim`` the query/key head size (nope + rope) the default scale is taken from.
    latent: PagedLatent | None = None
    # (interface v6) attention sinks: per query head a learned logit s_h in the softmax's
    # denominator only, weights exp(score) / (exp(s_h) + Σ exp(score)) (gpt-oss); the values come
    # to ``forward`` as ``sinks=`` (float32 [num_heads]), only when this is set
    sinks: bool = False

    @property
    def cache_layout(self) -> str:
        """:data:`PAGED_LATENT` for a latent spec, else :data:`PAGED_KV`."""
        return PAGED_KV if self.latent is None else PAGED_LATENT

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.query_scale is None else self.query_scale

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype of the cache tensors: ``kv_cache_dtype``, else the activation dtype."""
        return self.kv_cache_dtype or self.dtype


# vLLM's --kv-cache-dtype values -> the cache's storage dtype (None: the activation dtype).
# "fp8" is e4m3, as in vLLM on CUDA and the CPU.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    # not vLLM's: 2 bytes a value like bf16 with 3 more mantissa bits, under float32 activations
    "float16": torch.float16,
}


@attrs.frozen
class KVScale:
    """A layer's per-tensor KV cache scales: the cache holds ``k / k`` and ``v / v``. From the
    checkpoint's ``k_scale`` / ``v_scale`` (or one ``kv_scale``) of that layer when present,
    else 1.0, as vLLM does."""

    k: float = 1.0
    v: float = 1.0


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x / scale`` in the quantized cache ``dtype``: saturated to its largest finite value
    (a plain cast would turn an outlier into NaN or inf), rounded to nearest even."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Stored cache values ``x`` read back as ``x · scale`` in the activation ``dtype``."""
    return (x.float() * scale).to(dtype)


def kv_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@attrs.frozen
class BatchLayout:
    """The flattened batch of one step. Tensors live on the model's device."""

    query_start_loc: torch.Tensor  # [B + 1] int32: request b's queries are rows [qsl[b], qsl[b+1])
    seq_lens: torch.Tensor  # [B] int32: context length once this step's tokens are written
    block_table: torch.Tensor  # [B, max_blocks] int32, padded with the null block 0
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each row
    query_lens: tuple[int, ...]  # host copies, so backends need no device sync
    seq_lens_host: tuple[int, ...]

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


# The AttentionSpec fields a backend must honour that older interface versions did not promise:
# (what a spec asks, the version that made it part of the contract, whether ``spec`` asks it).
# They entered the spec under v1 without a bump; v4 is the bump.
ADDED_FIELDS: tuple[tuple[str, int, Callable[[AttentionSpec], bool]], ...] = (
    ("sliding window", 4, lambda spec: spec.sliding_window is not None),
    ("logit soft-capping", 4, lambda spec: spec.logit_softcap is not None),
    ("query scale", 4, lambda spec: spec.query_scale is not None),
    ("bidirectional attention", 4, lambda spec: not spec.causal),
    ("the paged latent cache layout", 5, lambda spec: spec.latent is not None),
    ("attention sinks", 6, lambda spec: spec.sinks),
)
REGISTRY_SINCE = 4  # backends registered for this version on are constructed with ``registry=``


def unknown_to(api: int) -> list[tuple[str, int]]:
    """(field, version) of what a backend built for interface ``api`` never heard of."""
    return [(label, since) for label, since, _ in ADDED_FIELDS if since > api]


def _since(label: str) -> int:
    return next(since for field, since, _ in ADDED_FIELDS if field == label)


def spec_for_version(spec: AttentionSpec, api: int) -> tuple[AttentionSpec, list[str]]:
    """(the spec to hand a backend built for interface ``api``, why it cannot serve ``spec``).
    A query scale equal to the default ``head_dim ** -0.5`` is dropped for it, which is exact
    (``scale`` is the same number); any other field added after ``api`` that ``spec`` sets is
    a reason, since the backend would ignore it and attend wrongly."""
    if api < _since("query scale") and spec.query_scale == spec.head_dim**-0.5:
        spec = attrs.evolve(spec, query_scale=None)
    asked = [(label, since) for label, since, asks in ADDED_FIELDS if since > api and asks(spec)]
    if not asked:
        return spec, []
    labels = ", ".join(label for label, _ in asked)
    since = max(since for _, since in asked)
    return spec, [f"built for interface v{api}: cannot serve {labels} (part of the contract since v{since})"]


def backend_reasons(
    cls: type[AttentionBackend], api: int, spec: AttentionSpec, platform: Platform
) -> tuple[AttentionSpec, list[str]]:
    """(the spec to hand ``cls``, why it cannot serve ``spec`` on ``platform``): its interface
    version (:func:`spec_for_version`), its ``supports`` (one that raises is a reason, so one
    plugin's bug cannot stop selection), and batch invariance it does not declare."""
    handed, reasons = spec_for_version(spec, api)
    try:
        reasons += list(cls.supports(handed, platform))
    except Exception as exc:  # noqa: BLE001 - any error in the plugin's check
        error = " ".join(str(exc).split())
        reasons.append(f"{cls.supports.__qualname__} raised {type(exc).__name__}: {error}")
    if spec.cache_layout not in cls.cache_layouts:
        reasons.append(
            f"it does not read the {spec.cache_layout} cache layout (layouts it reads: "
            f"{', '.join(cls.cache_layouts)})"
        )
    if spec.batch_invariant and not cls.batch_invariant_capable:
        reasons.append("it has no batch-invariant mode")
    if spec.kv_cache_dtype is not None and spec.kv_cache_dtype not in cls.kv_cache_dtypes:
        reads = ", ".join(kv_dtype_name(d) for d in cls.kv_cache_dtypes) or "none"
        reasons.append(
            f"it cannot read a {kv_dtype_name(spec.kv_cache_dtype)} KV cache "
            f"(quantized KV dtypes it reads: {reads})"
        )
    return handed, reasons


def construct(
    cls: type[AttentionBackend], api: int, spec: AttentionSpec, platform: Platform, registry: Any
) -> AttentionBackend:
    """``cls`` built as its interface version expects: with ``registry=`` from v4 on."""
    return cls(spec, platform, registry=registry) if api >= REGISTRY_SINCE else cls(spec, platform)


def build_backend(registry: Any, name: str, spec: AttentionSpec, platform: Platform) -> AttentionBackend:
    """(interface v4) The backend ``name`` selects in ``registry`` (a backend's own
    ``self.registry``: the plugins the engine loaded, under ``--plugins``; ``"<plugin>:<name>"``
    for one plugin's), checked and built for ``spec`` and ``platform`` as the engine builds the
    backend it selects: for a backend that hands some batches to another. ValueError when no
    usable plugin registers ``name``, RuntimeError with the reasons when it cannot serve ``spec``."""
    if registry is None:
        raise ValueError(
            f"attention backend {name!r}: no plugin registry to find it in (a backend built by "
            "hand that builds another needs registry=, e.g. engine.plugins.load_plugins())"
        )
    registration = registry.registration("attention_backends", name)
    cls = registration.load()
    handed, reasons = backend_reasons(cls, registration.api, spec, platform)
    if reasons:
        raise RuntimeError(f"attention backend {name!r} cannot run here: {'; '.join(reasons)}")
    return construct(cls, registration.api, handed, platform, registry)


def head_layout_reasons(spec: AttentionSpec) -> list[str]:
    """What a paged kernel cannot be asked, whatever it is: query heads that are not a multiple
    of the KV heads (no KV head to group them under), and a sliding window without causality
    (the window ends at a query's own position). For a backend's ``supports``."""
    reasons = []
    if spec.num_heads % spec.num_kv_heads:
        reasons.append(f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads")
    if not spec.causal and spec.sliding_window is not None:
        reasons.append("bidirectional attention with a sliding window")
    return reasons


# what a backend declares in ``AttentionBackend.cuda_graph_support``
CUDA_GRAPH_SUPPORT = ("none", "decode-only", "full")


class AttentionBackend(ABC):
    name: ClassVar[str]
    block_dim: ClassVar[int] = 1  # which dimension of ``kv_cache_shape`` indexes blocks
    # honours AttentionSpec.batch_invariant; a backend that does not is never chosen for it
    batch_invariant_capable: ClassVar[bool] = False
    # (optional, defaulted: no version bump) for every spec it serves, a query row's output is
    # bit for bit the same whatever call it arrives in: the whole prompt at once or a later
    # chunk of any start and length, its prefix written by an earlier call of its own or by
    # another request's (prefix caching), other requests beside it or not. The attention kit
    # checks it where declared; batch-invariant engines keep prefix caching and chunked prefill
    # only when every backend they use declares it, and default-mode greedy output is
    # reproducible only then (``EngineCore.determinism``).
    chunk_invariant: ClassVar[bool] = False
    # (interface v2) which steps a platform's step graphs (CUDA graphs on cuda, native tapes on
    # cpu-native: ``Platform.step_graphs``) may record with this backend. "decode-only": the
    # metadata ``build_graph_metadata`` builds for a batch of B requests of one query row each
    # stays valid when the layout's tensors are overwritten in place with another such batch of
    # B (the host tuples may differ, and the padding rows the graph runner adds have seq_len 1
    # and the null block), and ``forward`` neither syncs with the host nor allocates outside the
    # capture (nor, for a tape, computes outside its C kernels); "full": the same for any batch
    # of a fixed number of tokens (the graph runner records decode steps only, for now);
    # "none": always eager
    cuda_graph_support: ClassVar[str] = "none"
    # (optional, defaulted: no version bump) the quantized KV cache dtypes (values of
    # KV_CACHE_DTYPES) this backend reads beside the activation dtype; a spec asking another is
    # never handed to it. A backend listing any takes ``kv_scale=`` in ``forward``.
    kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()
    # (interface v5) the cache layouts this backend reads (:data:`PAGED_KV`, :data:`PAGED_LATENT`);
    # a spec asking another is never handed to it. One reading PAGED_LATENT implements
    # ``forward_latent``.
    cache_layouts: ClassVar[tuple[str, ...]] = (PAGED_KV,)

    def __init__(self, spec: AttentionSpec, platform: Platform, registry: Any = None):
        self.spec = spec
        self.platform = platform
        # (interface v4) the engine's plugin registry — the plugins it loaded, under --plugins —
        # for a backend that hands some batches to another (:func:`build_backend`); None when the
        # backend is built by hand. A subclass overriding __init__ passes it on.
        self.registry = registry

    @classmethod
    @abstractmethod
    def supports(cls, spec: AttentionSpec, platform: Platform) -> list[str]:
        """Reasons this backend cannot serve ``spec`` on ``platform``; empty when it can."""

    @classmethod
    def describe(cls, spec: AttentionSpec, platform: Platform) -> str | None:
        """(interface v2) Which of the backend's paths would run ``spec`` on ``platform``, and
        why not another, for ``engine plugins`` and the start-up log; None: one path only."""
        return None

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor. Default: [2, blocks, block_size, kv_heads, head_dim].
        A backend with another layout sets ``block_dim`` to where the blocks are."""
        s = self.spec
        return (2, num_blocks, s.block_size, s.num_kv_heads, s.head_dim)

    def build_metadata(self, layout: BatchLayout) -> object:
        """Backend-specific per-step metadata, built once and shared by all layers."""
        return layout

    def build_graph_metadata(self, layout: BatchLayout) -> object:
        """(interface v3) Metadata for a recorded decode step: ``layout``'s tensors are the
        graph's static buffers, overwritten before every replay, so what it builds must read
        them when the forward runs (see ``cuda_graph_support``). Default: ``build_metadata``,
        right for a backend whose metadata holds the layout's tensors themselves."""
        return self.build_metadata(layout)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, H_kv, D] -> output [T, H, D]. With a quantized cache
        (``spec.kv_cache_dtype``) the engine also passes ``kv_scale=`` (:class:`KVScale`): K/V
        are written as :func:`quantize_kv` stores them and read back multiplied by it. With
        ``spec.sinks`` (v6) it passes ``sinks=``, the layer's float32 [H] sink logits."""

    def forward_latent(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: object,
        up: LatentUpProjection,
    ) -> torch.Tensor:
        """(interface v5, a backend reading :data:`PAGED_LATENT`) q_nope [T, H, Dn] and q_rope
        [T, H, Dr] (rotated) of the queries; latent [T, kv_lora_rank] (normalized) and k_rope
        [T, Dr] (rotated) of this step's tokens, written to the cache through the slot mapping as
        one ``entry_dim`` vector each; -> output [T, H, Dv]: softmax(q·k · scale) · v per head
        over each request's context, where a head's k is ``[up.key @ latent, k_rope]`` and its v
        ``up.value @ latent`` (how it computes that, decompressed or absorbed, is the backend's)."""
        raise NotImplementedError(f"attention backend {self.name!r} does not read the paged latent layout")
