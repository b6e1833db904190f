"""GLM-4-0414 dense decoders (``Glm4ForCausalLM``: GLM-4-9B/32B-0414, GLM-Z1) on the core's
pre-norm decoder (:class:`engine.layers.DecoderForCausalLM`), as ``transformers`` implements
them: q/k/v biased and o not, a rotation over the first ``partial_rotary_factor`` of each head
(0.5) in GLM's interleaved layout (neighbouring dims pair up), a sandwich of norms (the
attention's and the MLP's outputs RMS-normed before they join the residual stream:
``post_self_attn_layernorm``, ``post_mlp_layernorm``) and the checkpoint's fused
``gate_up_proj`` cut into the gate and up shards the shared MLP loads."""

from __future__ import annotations

from engine.layers import DecoderAttention, DecoderForCausalLM, DecoderLayer, GatedMLP, split_fused


class Glm4ForCausalLM(DecoderForCausalLM):
    architectures = ("Glm4ForCausalLM",)
    tensor_parallel_capable = True  # DecoderAttention and GatedMLP blocks only

    def decoder_layer(self, cfg, index, method, dtype, ops):
        attention = DecoderAttention(
            cfg,
            index,
            method,
            dtype,
            ops,
            qkv_bias=getattr(cfg, "attention_bias", True),
            interleaved_rotary=True,
        )
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, method, dtype, ops)
        return DecoderLayer(attention, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype, ops, post_norms=True)

    def load_weights(self, weights):
        size = self.cfg.intermediate_size
        super().load_weights(split_fused(weights, {"gate_up_proj": [("gate_proj", size), ("up_proj", size)]}))

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            return [f"hidden_act {hf_config.hidden_act!r} is not supported (SwiGLU only)"]
        return []

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        """GLM-4-0414's shape (GQA, biased q/k/v, untied head, half of each head rotated) and one
        with a tied head, no biases and a quarter of each head rotated."""
        tiny = dict(
            model_type="glm4",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            pad_token_id=0,
            eos_token_id=2,
        )
        return {
            "Glm4ForCausalLM": dict(**tiny, tie_word_embeddings=False, attention_bias=True),
            "Glm4ForCausalLM-tied-quarter-rotary": dict(
                **tiny, tie_word_embeddings=True, attention_bias=False, partial_rotary_factor=0.25
            ),
        }
