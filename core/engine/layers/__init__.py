"""Building blocks model plugins share: linear layers that go through the selected
QuantMethod (vocabulary tables included), RMSNorm, rotary embeddings, the paged attention layer, and checkpoint loading;
all are :class:`Layer` s (modules called without torch hooks)."""

from engine.layers.attention import Attention
from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear
from engine.layers.loading import FUSED_PROJECTIONS, load_checkpoint
from engine.layers.module import Layer
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rotary_qkv, silu_and_mul

__all__ = ["FUSED_PROJECTIONS", "Attention", "Layer", "Linear", "RMSNorm", "RotaryEmbedding",
           "VocabEmbedding", "load_checkpoint", "rotary_qkv", "silu_and_mul"]
