"""Building blocks model plugins share: linear layers that go through the selected
QuantMethod (vocabulary tables included), RMSNorm, rotary embeddings, the paged attention
layer, the pre-norm decoder stack most causal LMs share (:class:`DecoderForCausalLM`), the
small ops between matmuls (:class:`LayerOps`, which a platform may replace with kernels),
mixture-of-experts layers (:mod:`engine.layers.moe`) and checkpoint loading. The modules
are :class:`Layer` s (called without hooks)."""

from engine.layers.attention import Attention, LatentAttention
from engine.layers.classifier import DecoderSequenceClassifier
from engine.layers.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    PostNormDecoderLayer,
    head_dim,
)
from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear
from engine.layers.loading import (
    FUSED_PROJECTIONS,
    decoder_rename,
    load_checkpoint,
    load_whole,
    route_by_prefix,
    split_fused,
)
from engine.layers.mamba import Mamba2Mixer, Mamba2Shape
from engine.layers.module import Layer
from engine.layers.moe import FusedMoE, router_linear
from engine.layers.norm import RMSNorm
from engine.layers.ops import LayerOps
from engine.layers.rotary import RotaryEmbedding
from engine.layers.unquantized import UnquantizedLinearMethod

__all__ = [
    "FUSED_PROJECTIONS",
    "Attention",
    "DecoderAttention",
    "DecoderForCausalLM",
    "DecoderLayer",
    "DecoderModel",
    "DecoderSequenceClassifier",
    "FusedMoE",
    "GatedMLP",
    "LatentAttention",
    "Layer",
    "LayerOps",
    "Linear",
    "Mamba2Mixer",
    "Mamba2Shape",
    "PostNormDecoderLayer",
    "RMSNorm",
    "RotaryEmbedding",
    "UnquantizedLinearMethod",
    "VocabEmbedding",
    "decoder_rename",
    "head_dim",
    "load_checkpoint",
    "load_whole",
    "route_by_prefix",
    "router_linear",
    "split_fused",
]
