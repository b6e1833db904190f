"""OLMo 2 dense decoders on the core's decoder stack (:class:`engine.layers.DecoderForCausalLM`):
post-norm blocks (attention and MLP read the residual stream unnormed, and their outputs are
RMS-normed before they join it: :class:`engine.layers.PostNormDecoderLayer`) and an RMSNorm
over the whole projected q and the whole projected k before the rotation (not per head).
Parameter names are Hugging Face's."""

from __future__ import annotations

from engine.layers import DecoderAttention, DecoderForCausalLM, GatedMLP, PostNormDecoderLayer


class Olmo2ForCausalLM(DecoderForCausalLM):
    architectures = ("Olmo2ForCausalLM",)
    # not tensor-parallel: the q/k norms span every head, and a rank holds only its own

    def decoder_layer(self, cfg, index, method, dtype, ops):
        bias = getattr(cfg, "attention_bias", False)
        attention = DecoderAttention(
            cfg, index, method, dtype, ops, qkv_bias=bias, o_bias=bias, qk_projection_norm=True
        )
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, method, dtype, ops)
        return PostNormDecoderLayer(attention, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            return [f"hidden_act {hf_config.hidden_act!r} is not supported (SwiGLU only)"]
        return []

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        """OLMo 2's shape (MHA, untied head), and one with GQA, a tied head and biased
        projections (OLMo 2 1B and 7B share the former)."""
        tiny = dict(
            model_type="olmo2",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        return {
            "Olmo2ForCausalLM": dict(**tiny, num_key_value_heads=4, tie_word_embeddings=False),
            "Olmo2ForCausalLM-gqa-tied-bias": dict(
                **tiny, num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True
            ),
        }
