"""The pre-norm decoder most causal LMs share (Llama, Mistral, Qwen2, Qwen3 and their MoE
siblings): token embedding, rotary tables looked up once per step, layers of norm → attention
→ norm → MLP with the residual stream carried beside the hidden state (each norm adds it in,
which a platform fuses), a final norm and a tied or untied LM head. A family subclasses
:class:`DecoderForCausalLM` and builds each layer (:meth:`~DecoderForCausalLM.decoder_layer`),
usually a :class:`DecoderLayer` of a :class:`DecoderAttention` and a :class:`GatedMLP` (or its
own blocks); parameter names are Hugging Face's, so checkpoints load as they are."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from engine.distributed import current_tensor_parallel
from engine.interfaces.model import AttentionKind, KVLayout, Model
from engine.layers.attention import Attention
from engine.layers.embedding import VocabEmbedding
from engine.layers.loading import decoder_rename, load_checkpoint
from engine.layers.module import Layer
from engine.layers.norm import RMSNorm
from engine.layers.ops import LayerOps
from engine.layers.parallel import ColumnParallelLinear, RowParallelLinear, attention_heads
from engine.layers.rotary import RotaryEmbedding


def head_dim(hf_config) -> int:
    """The config's ``head_dim`` where it sets one (Qwen3, Gemma), else hidden / heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class DecoderAttention(Layer):
    """Self-attention over a fused q|k|v projection (``qkv_proj``; the checkpoint's ``q_proj``,
    ``k_proj``, ``v_proj`` load into its shards): rotary embedding of q and k — after a
    per-head RMSNorm of each (``q_norm``, ``k_norm`` of size head_dim) when ``qk_norm`` is
    set, as Qwen3 does, or after one RMSNorm over the whole projected q and one over the whole
    k with ``qk_projection_norm`` (OLMo 2) — the paged attention of layer ``layer``, then
    ``o_proj``. Rotary tables narrower than a head (``partial_rotary_factor``) rotate only
    the head's first dims; ``interleaved_rotary`` turns pairs of neighbouring dims (GLM-4).
    Built for a tensor-parallel group, a rank holds its heads (``num_heads``, ``num_kv_heads``
    are the rank's) and ``o_proj`` all-reduces; a norm over the whole projection needs every
    head, so ``qk_projection_norm`` takes one rank. ``sinks`` (gpt-oss) gives every query head
    a learned sink logit (``sinks``, float32 [num_attention_heads], of which a rank hands the
    backend its heads'); the layer's kind must declare ``AttentionKind.sinks``."""

    def __init__(
        self,
        cfg,
        layer: int,
        method,
        dtype,
        ops: LayerOps,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        qk_projection_norm: bool = False,
        interleaved_rotary: bool = False,
        sinks: bool = False,
    ):
        super().__init__()
        self.ops = ops
        tp = current_tensor_parallel()
        if qk_projection_norm and tp.size > 1:
            raise ValueError("a q/k norm over the whole projection needs every head on one rank")
        heads = attention_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.q, heads.kv, head_dim(cfg)
        q_size, kv_size = cfg.num_attention_heads * self.head_dim, cfg.num_key_value_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [q_size, kv_size, kv_size],
            qkv_bias,
            method,
            dtype,
            heads.qkv_shards(self.head_dim),
        )
        self.o_proj = RowParallelLinear(
            q_size, cfg.hidden_size, o_bias, method, dtype, heads.o_shard(self.head_dim)
        )
        q_norm_size, k_norm_size = (q_size, kv_size) if qk_projection_norm else (self.head_dim, self.head_dim)
        with_norms = qk_norm or qk_projection_norm
        self.q_norm = RMSNorm(q_norm_size, cfg.rms_norm_eps, dtype, ops) if with_norms else None
        self.k_norm = RMSNorm(k_norm_size, cfg.rms_norm_eps, dtype, ops) if with_norms else None
        self.qk_projection_norm, self.interleaved_rotary = qk_projection_norm, interleaved_rotary
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(cfg.num_attention_heads), requires_grad=False)
        self.q_heads = slice(heads.q_start, heads.q_start + heads.q)
        self.attn = Attention(layer)

    def forward(self, cos_sin, hidden, step):
        qkv, heads = self.qkv_proj(hidden), (self.num_heads, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_projection_norm:
            q, k, v = self.ops.qk_norm_rotary(qkv, self.q_norm, self.k_norm, *heads, cos_sin)
        else:
            if self.qk_projection_norm:
                qkv = self._norm_projections(qkv)
            q, k, v = self._rotary(qkv, heads, cos_sin)
        sinks = None if self.sinks is None else self.sinks[self.q_heads]
        out = self.attn(q, k, v, step, sinks)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))

    def _norm_projections(self, qkv):
        """q|k|v with q and k each RMS-normed as a whole (the norms' sizes: H·D, H_kv·D)."""
        q_size, kv_size = self.q_norm.weight.shape[0], self.k_norm.weight.shape[0]
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)

    def _rotary(self, qkv, heads, cos_sin):
        if self.interleaved_rotary or cos_sin[0].shape[-1] < self.head_dim:
            return self.ops.partial_rotary_qkv(qkv, *heads, cos_sin, interleaved=self.interleaved_rotary)
        return self.ops.rotary_qkv(qkv, *heads, cos_sin)


class GatedMLP(Layer):
    """SwiGLU: a fused gate|up projection (``gate_up_proj``; the checkpoint's ``gate_proj`` and
    ``up_proj`` load into its shards), silu(gate) · up, ``down_proj`` (tensor-parallel: a rank
    holds its slice of gate and up, and ``down_proj`` all-reduces, unless ``reduce_results`` is
    False: then the caller reduces the rank's partial output, as a MoE layer's shared expert's)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        method,
        dtype,
        ops: LayerOps,
        reduce_results: bool = True,
    ):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, method, dtype)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, method, dtype, reduce_results=reduce_results
        )

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(Layer):
    """One pre-norm block. ``self_attn(cos_sin, hidden, step)`` and ``mlp(hidden)`` map
    [T, hidden] to [T, hidden]; the residual stream is returned beside the output, so the
    next layer's input norm adds it in one op. ``residual_multiplier`` (Granite) scales the
    attention's and the MLP's outputs before they join the stream; ``post_norms`` (GLM-4's
    sandwich) RMS-norms them first (``post_self_attn_layernorm``, ``post_mlp_layernorm``)."""

    def __init__(
        self,
        self_attn: Layer,
        mlp: Layer,
        hidden_size: int,
        eps: float,
        dtype,
        ops: LayerOps,
        residual_multiplier: float = 1.0,
        post_norms: bool = False,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype, ops)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype, ops)
        self.mlp = mlp
        self.residual_multiplier = residual_multiplier
        if post_norms:
            self.post_self_attn_layernorm = RMSNorm(hidden_size, eps, dtype, ops)
            self.post_mlp_layernorm = RMSNorm(hidden_size, eps, dtype, ops)
        self.post_norms = post_norms

    def forward(self, cos_sin, hidden, residual, step):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self._joining(self.self_attn(cos_sin, hidden, step), "post_self_attn_layernorm")
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self._joining(self.mlp(hidden), "post_mlp_layernorm"), residual

    def _joining(self, out, post_norm: str):
        """A block's output as it joins the residual stream: normed, scaled."""
        if self.post_norms:
            out = getattr(self, post_norm)(out)
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier


class PostNormDecoderLayer(Layer):
    """One post-norm block (OLMo 2): attention and MLP read the residual stream as it is, and
    their outputs are normed (``post_attention_layernorm``, ``post_feedforward_layernorm``)
    before they join it. Takes and returns (hidden, residual) as :class:`DecoderLayer` does,
    the stream being their sum."""

    def __init__(self, self_attn: Layer, mlp: Layer, hidden_size: int, eps: float, dtype, ops: LayerOps):
        super().__init__()
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype, ops)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(hidden_size, eps, dtype, ops)

    def forward(self, cos_sin, hidden, residual, step):
        stream = hidden if residual is None else hidden + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(cos_sin, stream, step))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class DecoderModel(Layer):
    """Embedding, the layers and the final norm (HF's ``model.*``); embeddings are multiplied
    by ``embedding_multiplier`` where it is not 1 (Granite)."""

    def __init__(
        self, cfg, layers: Iterable[Layer], method, dtype, ops: LayerOps, embedding_multiplier: float = 1.0
    ):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, method, dtype)
        self.embedding_multiplier = embedding_multiplier
        self.rotary = RotaryEmbedding(cfg, cfg.max_position_embeddings, dtype, ops)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def forward(self, input_ids, positions, step, num_layers: int | None = None):
        """Hidden states after the first ``num_layers`` layers (all when None) and the final
        norm; the residual stream after each of ``step.aux_layers`` goes to ``step.aux_hidden``."""
        hidden, residual = step.merge_multimodal(self.embed(input_ids)), None
        cos_sin = self.rotary(positions)
        layers = (
            self.layers if num_layers is None else self.layers[:num_layers]
        )  # a slice builds a ModuleList
        for index, layer in enumerate(layers):
            hidden, residual = layer(cos_sin, hidden, residual, step)
            if index in step.aux_layers:
                step.aux_hidden.append(hidden + residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def embed(self, input_ids):
        embedded = self.embed_tokens(input_ids)
        return embedded if self.embedding_multiplier == 1.0 else embedded * self.embedding_multiplier


class DecoderForCausalLM(Model):
    """A :class:`Model` around a :class:`DecoderModel`: the KV layout from the config, a tied
    or untied LM head, the embeddings (for EAGLE drafters) and a layer-skip draft view. A
    family implements :meth:`decoder_layer` (and ``architectures``, ``example_configs``,
    ``supports``); one built of :class:`DecoderAttention` and :class:`GatedMLP` blocks may set
    ``tensor_parallel_capable``."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.tensor_parallel = current_tensor_parallel()
        cfg = self.cfg = ctx.hf_config
        ops = ctx.layer_ops or LayerOps()
        layers = (
            self.decoder_layer(cfg, index, ctx.linear_method, ctx.dtype, ops)
            for index in range(cfg.num_hidden_layers)
        )
        self.model = DecoderModel(
            cfg, layers, ctx.linear_method, ctx.dtype, ops, self.embedding_multiplier(cfg)
        )
        self.tied = getattr(cfg, "tie_word_embeddings", False)
        if not self.tied:
            self.lm_head = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.linear_method, ctx.dtype)
            self.lm_head.serves_lookups = False
        (self.model.embed_tokens if self.tied else self.lm_head).serves_logits = True

    @abstractmethod
    def decoder_layer(self, cfg, index: int, method, dtype, ops: LayerOps) -> Layer:
        """Layer ``index``, usually a :class:`DecoderLayer` of the family's attention and MLP."""

    def embedding_multiplier(self, cfg) -> float:
        """What token embeddings are multiplied by (Granite's ``embedding_multiplier``); default 1."""
        return 1.0

    def layer_kinds(self) -> tuple[AttentionKind, ...]:
        """How each layer attends (:attr:`KVLayout.layer_kinds`); default: all alike, plain."""
        return ()

    def kv_layout(self) -> KVLayout:
        """This rank's heads: each tensor-parallel rank caches K/V for its own kv heads."""
        cfg = self.cfg
        heads = attention_heads(cfg.num_attention_heads, cfg.num_key_value_heads, self.tensor_parallel)
        return KVLayout(cfg.num_hidden_layers, heads.q, heads.kv, head_dim(cfg), self.layer_kinds())

    def forward(self, input_ids, positions, step):
        return self.model(input_ids, positions, step)

    def embed(self, input_ids):
        return self.model.embed(input_ids)

    def draft_view(self, num_layers: int):
        if not 0 < num_layers < self.cfg.num_hidden_layers:
            raise ValueError(f"self_draft_layers must be in [1, {self.cfg.num_hidden_layers - 1}]")
        return LayerSkipView(self, num_layers)

    def compute_logits(self, hidden):
        logits = self._head.logits(hidden)
        return None if logits is None else logits.float()

    def compute_greedy(self, hidden):
        """The LM head's own greedy tokens (``VocabEmbedding.greedy``) where ``compute_logits``
        is this class's (a subclass that changes the logits, Gemma's soft-cap, keeps the
        default: None)."""
        if type(self).compute_logits is not DecoderForCausalLM.compute_logits:
            return None
        return self._head.greedy(hidden)

    @property
    def _head(self):
        return self.model.embed_tokens if self.tied else self.lm_head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, weights, decoder_rename(self.tied))


class LayerSkipView(nn.Module):
    """The first layers of a decoder and its LM head, sharing the target's modules."""

    def __init__(self, target: DecoderForCausalLM, num_layers: int):
        super().__init__()
        self.num_layers = num_layers
        self._target = [target]  # a list, so the target is not registered as a submodule twice

    def kv_layout(self) -> KVLayout:
        full = self._target[0].kv_layout()
        return KVLayout(
            self.num_layers,
            full.num_heads,
            full.num_kv_heads,
            full.head_dim,
            full.layer_kinds[: self.num_layers],
        )

    def forward(self, input_ids, positions, step):
        return self._target[0].model(input_ids, positions, step, num_layers=self.num_layers)

    def compute_logits(self, hidden):
        return self._target[0].compute_logits(hidden)
