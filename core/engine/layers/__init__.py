"""Building blocks model plugins share: linear layers that go through the selected
QuantMethod, RMSNorm, rotary embeddings, and the paged attention layer."""

from engine.layers.attention import Attention
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary, silu_and_mul

__all__ = ["Attention", "Linear", "RMSNorm", "RotaryEmbedding", "apply_rotary", "silu_and_mul"]
