"""IBM Granite 3.x dense decoders on the core's pre-norm decoder
(:class:`engine.layers.DecoderForCausalLM`): Llama's blocks with four scalars from the config —
embeddings multiplied by ``embedding_multiplier``, each attention and MLP output by
``residual_multiplier`` before it joins the residual stream, attention logits scaled by
``attention_multiplier`` (in place of head_dim ** -0.5) and the final logits divided by
``logits_scaling``. Parameter names are Hugging Face's."""

from __future__ import annotations

from engine.interfaces import AttentionKind
from engine.layers import DecoderAttention, DecoderForCausalLM, DecoderLayer, GatedMLP


class GraniteForCausalLM(DecoderForCausalLM):
    architectures = ("GraniteForCausalLM",)
    tensor_parallel_capable = True  # DecoderAttention and GatedMLP blocks only

    def decoder_layer(self, cfg, index, method, dtype, ops):
        bias = getattr(cfg, "attention_bias", False)
        attention = DecoderAttention(cfg, index, method, dtype, ops, qkv_bias=bias, o_bias=bias)
        mlp = GatedMLP(
            cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False), method, dtype, ops
        )
        return DecoderLayer(
            attention, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype, ops, cfg.residual_multiplier
        )

    def embedding_multiplier(self, cfg) -> float:
        return cfg.embedding_multiplier

    def layer_kinds(self) -> tuple[AttentionKind, ...]:
        """Every layer scales its queries by ``attention_multiplier``."""
        return (AttentionKind(query_scale=self.cfg.attention_multiplier),) * self.cfg.num_hidden_layers

    def compute_logits(self, hidden):
        logits = super().compute_logits(hidden)
        return None if logits is None else logits / self.cfg.logits_scaling

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            return [f"hidden_act {hf_config.hidden_act!r} is not supported (SwiGLU only)"]
        return []

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        """Granite 3's shape (GQA, tied head) and an untied MHA one with biased projections, both
        with every multiplier away from 1 (Granite 3.0 2B's embedding and logits values; the
        attention multiplier differs from head_dim ** -0.5)."""
        tiny = dict(
            model_type="granite",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.1,
            logits_scaling=8.0,
        )
        return {
            "GraniteForCausalLM": dict(**tiny, num_key_value_heads=2, tie_word_embeddings=True),
            "GraniteForCausalLM-untied-bias": dict(
                **tiny, num_key_value_heads=4, tie_word_embeddings=False, attention_bias=True, mlp_bias=True
            ),
        }
