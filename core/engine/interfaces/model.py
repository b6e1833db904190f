"""Model: a network over the flattened token axis, built from an HF ``config.json``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from engine.interfaces.attention import PagedLatent

# The name a fallback model class registers under (``register(FALLBACK_ARCHITECTURE, ...)``): it
# serves any architecture no model plugin claims (``model_impl="auto"``), or every one
# (``model_impl="transformers"``, vLLM's spelling). models-transformers runs transformers' own
# modelling code this way.
FALLBACK_ARCHITECTURE = "*"


@attrs.frozen
class MambaState:
    """(models v4) The fixed-size state a Mamba2 layer keeps per request instead of a KV cache:
    the last ``conv_kernel - 1`` inputs of its causal depthwise convolution over ``conv_dim``
    channels, and its SSM state [heads, head_dim, state_size]. Both live in one float32 row per
    request slot (``elements``), whatever the activation dtype: the recurrence accumulates over
    the whole sequence, so it is kept in full precision (vLLM's ``mamba_ssm_cache_dtype`` float32)."""

    conv_dim: int
    conv_kernel: int
    num_heads: int
    head_dim: int
    state_size: int

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)

    @property
    def elements(self) -> int:
        """float32 elements of one request's state."""
        conv, ssm = self.conv_shape, self.ssm_shape
        return conv[0] * conv[1] + ssm[0] * ssm[1] * ssm[2]

    def views(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's state tensor [num_slots, elements] -> its conv states [num_slots, conv_dim,
        conv_kernel - 1] and SSM states [num_slots, heads, head_dim, state_size], views of it."""
        conv_elements = self.conv_shape[0] * self.conv_shape[1]
        conv = slots[:, :conv_elements].view(-1, *self.conv_shape)
        return conv, slots[:, conv_elements:].view(-1, *self.ssm_shape)


@attrs.frozen
class AttentionKind:
    """How one layer attends, beyond the heads every layer shares: the
    :class:`engine.interfaces.AttentionSpec` fields a model may set per layer."""

    sliding_window: int | None = None  # a query sees this many keys ending at its own; None: all
    logit_softcap: float | None = None  # logits become cap · tanh(logits / cap); None: not capped
    query_scale: float | None = None  # None: head_dim ** -0.5
    # (models v3) the layer caches one latent vector per token (MLA), attended through
    # engine.layers.LatentAttention; None: per-head K/V (engine.layers.Attention)
    latent: PagedLatent | None = None
    # (models v4) the layer attends nothing: it is a Mamba2 mixer keeping this state per request
    # in a state group (one slot per running request); its ``kv_caches`` entry is the state tensor
    # [num_slots, state.elements] and its metadata the group's BatchLayout (slot: block_table[:, 0])
    state: MambaState | None = None
    # (models v4) the layer has learned per-head attention sink logits (gpt-oss), which it hands
    # to engine.layers.Attention as ``sinks=``; only a backend of attention interface v6 or later
    # that supports them serves it
    sinks: bool = False


@attrs.frozen
class KVLayout:
    """What the KV cache must hold for this model. ``layer_kinds`` (one per layer; empty: every
    layer the plain kind) lets layers attend differently — Gemma's sliding-window and global
    layers: the engine builds one attention backend per distinct kind, and the KV cache keeps
    sliding-window layers' blocks only while a window reaches them. A layer whose kind sets
    ``latent`` (models v3) caches a :class:`PagedLatent` vector per token instead of per-head
    K/V; its backend reads that layout, and the pool is sized from each layer's own bytes per
    token (``num_kv_heads`` 1 and ``head_dim`` the query/key head size for such a layer). A
    layer whose kind sets ``state`` (models v4) holds a :class:`MambaState` per request in a
    state group; a model of such layers only (Mamba2) sets the head fields to anything positive."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_kinds: tuple[AttentionKind, ...] = ()
    causal: bool = True  # False: every position attends to the whole prompt (encoders such as BERT)

    def kind(self, layer: int) -> AttentionKind:
        return self.layer_kinds[layer] if self.layer_kinds else AttentionKind()


@attrs.frozen
class ModelContext:
    """Everything a model constructor gets. ``linear_method`` builds each linear layer's
    storage and matmul (the selected :class:`QuantMethod`); ``layer_ops`` runs the small ops
    between matmuls (an :class:`engine.layers.LayerOps`, from the platform; None: plain torch).
    ``limit_mm_per_prompt``: vLLM's per-modality item limit (None: none); a multimodal model
    builds and loads no encoder for a modality limited to 0."""

    hf_config: Any
    dtype: torch.dtype
    device: torch.device
    linear_method: Any
    layer_ops: Any = None
    limit_mm_per_prompt: dict[str, int] | None = None

    def takes(self, modality: str) -> bool:
        """Whether requests may carry items of ``modality`` (its limit is not 0)."""
        return (self.limit_mm_per_prompt or {}).get(modality) != 0


@attrs.frozen
class StepContext:
    """Per-step state passed down ``forward`` (never kept in module globals).

    When ``aux_layers`` is set (an EAGLE-3 drafter asks), the model appends the residual
    stream after each of those layers ([T, hidden]) to ``aux_hidden``, in layer order.

    When the model's layers attend differently (``KVLayout.layer_kinds``), ``layers`` holds each
    layer's (AttentionBackend, its metadata for this step); ``attention`` and ``attn_metadata``
    are then layer 0's. :class:`engine.layers.Attention` picks the right pair.

    With a KV connector, ``kv_connector`` is its worker half and ``slot_mapping`` the step's
    slots: :class:`engine.layers.Attention` calls ``wait_for_layer_load`` before each layer's
    attention and ``save_kv_layer`` after it (a model attending without that layer calls them)."""

    attention: Any  # the AttentionBackend instance
    attn_metadata: object
    kv_caches: list[torch.Tensor]
    aux_layers: tuple[int, ...] = ()
    aux_hidden: list | None = None
    layers: tuple[tuple[Any, object], ...] = ()
    kv_connector: Any = None  # the KV connector's worker half, or None
    slot_mapping: torch.Tensor | None = None  # [T] cache slots of this step's tokens (with kv_connector)
    # a multimodal model's image rows this step: the token embeddings of rows ``mm_rows`` [N] are
    # replaced by ``mm_embeds`` [N, hidden] (its encoder's output, sliced to this step's chunk)
    mm_rows: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None

    def layer_attention(self, layer: int) -> tuple[Any, object]:
        """(backend, metadata) of ``layer``."""
        return self.layers[layer] if self.layers else (self.attention, self.attn_metadata)

    def merge_multimodal(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``embeddings`` [T, hidden] of the step's tokens with the image rows replaced by
        their encoder output (unchanged for a text-only step)."""
        if self.mm_rows is None or self.mm_embeds is None:
            return embeddings
        merged = embeddings.clone()
        merged[self.mm_rows] = self.mm_embeds.to(embeddings.dtype)
        return merged


@attrs.frozen
class ProcessedImage:
    """One image as the model takes it: ``data`` the tensors its ``encode_multimodal`` reads
    (``pixel_values`` ...), ``num_tokens`` the placeholder tokens it takes in the prompt (the
    rows of its encoder output)."""

    data: dict[str, torch.Tensor]
    num_tokens: int


class MultiModalProcessor(ABC):
    """How a multimodal model's images become its inputs, built once per engine from the
    checkpoint folder (usually around its ``transformers`` processor, which owns resizing and
    normalization). Supplied by the model class as ``Model.multimodal_processor``: the token
    count it reports must be the rows its model's encoder returns, so both live together."""

    placeholder_token_id: int  # the token a prompt marks each image with (LLaVA's ``<image>``)

    def __init__(self, model_path: str, hf_config: Any, processor_kwargs: dict | None = None):
        """``processor_kwargs``: vLLM's ``mm_processor_kwargs`` (``--mm-processor-kwargs``),
        handed only to a subclass whose ``__init__`` takes the parameter (one that does not is
        refused when they are given); it should refuse a key it does not know."""
        self.model_path = model_path
        self.hf_config = hf_config
        self.processor_kwargs = dict(processor_kwargs or {})

    @abstractmethod
    def process_image(self, image: Any) -> ProcessedImage:
        """A PIL image -> its tensors and placeholder token count."""


class Model(nn.Module, ABC):
    architectures: ClassVar[tuple[str, ...]]
    # False for a model without an LM head (an encoder): it only pools, and ``runner="auto"``
    # picks the pooling runner for it
    generative: ClassVar[bool] = True
    # how the pooling runner pools this model's final hidden states unless --pooler-config says
    # otherwise: LAST (a causal decoder used for embeddings), CLS or MEAN
    default_pooling_type: ClassVar[str] = "LAST"
    # built inside ``engine.distributed.tensor_parallel(group)``, the model holds one rank's
    # share (its layers are the parallel ones of ``engine.layers``, its ``kv_layout`` the
    # rank's heads, ``compute_logits`` None off rank 0); False: tensor_parallel_size must be 1
    tensor_parallel_capable: ClassVar[bool] = False
    # a multimodal model's processor class (images -> tensors, placeholder counts); None: text only
    multimodal_processor: ClassVar[type[MultiModalProcessor] | None] = None
    # a sequence classifier (a cross-encoder, a reranker) sets its number of labels: the pooling
    # runner's ``classify`` task then runs :meth:`classify` on the pooled hidden states
    num_labels: int = 0
    # (models v5) the position axes of each token: 1, one position per token; more (Qwen2-VL's
    # M-RoPE: temporal, height, width) and ``forward`` gets ``positions`` [position_axes, T], the
    # prompt's from :meth:`prompt_positions`, every later token's its index plus that offset
    position_axes: ClassVar[int] = 1
    # (models v6) a module only a drafter builds (an MTP module: :meth:`mtp_architecture`), never
    # a target: the model contract skips it
    drafter_only: ClassVar[bool] = False

    def __init__(self, ctx: ModelContext):
        super().__init__()
        self.ctx = ctx

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        """Reasons this class cannot serve ``hf_config`` (e.g. an unsupported attention
        variant); empty when it can."""
        return []

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        """Tiny HF config kwargs per claimed architecture; the conformance kit builds random
        models from them and compares logits with ``transformers``."""
        return {}

    @abstractmethod
    def kv_layout(self) -> KVLayout:
        """Layers, heads and head size the KV cache is sized for."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
        """input_ids, positions [T] ([position_axes, T] for a model of several axes) -> hidden
        states [T, hidden] (after the final norm: what ``compute_logits`` takes, and what the
        pooling runner pools)."""

    def prompt_positions(self, prompt_token_ids: list[int], mm_items: tuple) -> tuple[torch.Tensor, int]:
        """(models v5; required with ``position_axes`` > 1) The positions [position_axes, P] of a
        prompt's P tokens, whose images are ``mm_items`` (:class:`engine.messages.multimodal.
        MultiModalItem`: spans and processed data), and the offset of every later token: token
        ``i >= P`` sits at ``i + offset`` on every axis (Qwen2-VL's ``rope_deltas``). Computed
        once per request; a prefix of the prompt must get the same positions whatever follows
        it (prefix-cached blocks keep theirs)."""
        raise NotImplementedError(f"{type(self).__name__} has one position axis")

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (only rows that sample) -> logits [N, vocab] in float32."""

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(optional) For a step whose rows all decode greedily (no logprobs, masks, penalties
        or logits processors): each row's first maximum of ``compute_logits(hidden)`` (int64
        [N]; NaN counts as the maximum), the same token exactly, found without the logits
        where the LM head can (:meth:`engine.layers.VocabEmbedding.greedy`). None: the engine
        computes the logits and takes their argmax; this default. Step graphs may record it
        with the forward for small decode batches (:mod:`engine.runner.step_graphs`), so it
        must compute on tensors, not steer Python by their values, where it is to be recorded
        (a recording that does is dropped, and those steps call it eagerly)."""
        return None

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """A classifier's head: pooled hidden states [N, hidden] (one row per request, pooled as
        the pooler config says: ``default_pooling_type`` unless overridden) -> logits
        [N, num_labels]. Required with ``num_labels``."""
        raise NotImplementedError(f"{type(self).__name__} has no classification head")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] (EAGLE-style drafters feed them to their head)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its embeddings")

    def encode_multimodal(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's processed inputs (:attr:`ProcessedImage.data`, on this model's device)
        -> its embeddings [num_tokens, hidden], which ``forward`` receives through
        :meth:`StepContext.merge_multimodal`. Required with ``multimodal_processor``."""
        raise NotImplementedError(f"{type(self).__name__} takes no images")

    @classmethod
    def mtp_architecture(cls, hf_config) -> str | None:
        """(models v6) The registered architecture of this checkpoint's multi-token-prediction
        module (DeepSeek-V3's ``DeepSeekMTPModel``), None when it has none. An MTP drafter builds
        it from the target's own checkpoint (``DrafterContext.load_model(None, architecture=)``):
        it loads only its own weights, and its ``forward`` takes, beside the usual arguments,
        ``previous_hidden_states`` [T, hidden] (the target's output hidden state of the position
        before each row, or its own output for chained drafts), ``inputs_embeds`` [T, hidden]
        (the target's embeddings of ``input_ids``) and ``depth`` (the draft step, for a module of
        several layers); it returns the hidden states [T, hidden] that chain, which
        ``compute_logits(hidden, depth)`` turns into logits."""
        return None

    def draft_view(self, num_layers: int) -> Model | None:
        """A model that runs only the first ``num_layers`` layers and the LM head, sharing
        this model's weights (and, through the same layer indices, its KV cache): the draft
        for layer-skip self-speculation. None if unsupported."""
        return None

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume (HF parameter name, tensor) pairs streamed by the model loader."""
