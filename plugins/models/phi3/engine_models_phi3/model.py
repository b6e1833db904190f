"""Phi-3 (mini, medium) and Phi-4 (Phi-4, Phi-4-mini) dense decoders, which share
``Phi3ForCausalLM``, on the core's pre-norm decoder (:class:`engine.layers.DecoderForCausalLM`):
Llama's blocks, with the checkpoint's fused ``qkv_proj`` and ``gate_up_proj`` cut into the
projections the shared layers load, a rotation over part of each head (``partial_rotary_factor``,
Phi-4-mini), LongRoPE's short and long frequencies (the 128k checkpoints) and a sliding window
on every layer (``sliding_window``, Phi-3-mini)."""

from __future__ import annotations

from engine.interfaces import AttentionKind
from engine.layers import DecoderAttention, DecoderForCausalLM, DecoderLayer, GatedMLP, head_dim, split_fused


class Phi3ForCausalLM(DecoderForCausalLM):
    architectures = ("Phi3ForCausalLM",)
    tensor_parallel_capable = True  # DecoderAttention and GatedMLP blocks only

    def decoder_layer(self, cfg, index, method, dtype, ops):
        attention = DecoderAttention(cfg, index, method, dtype, ops)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, method, dtype, ops)
        return DecoderLayer(attention, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def layer_kinds(self) -> tuple[AttentionKind, ...]:
        """``sliding_window``, when set, applies to every layer (as in ``transformers``' mask)."""
        window = getattr(self.cfg, "sliding_window", None)
        return (AttentionKind(sliding_window=window),) * self.cfg.num_hidden_layers if window else ()

    def load_weights(self, weights):
        cfg = self.cfg
        q_size = cfg.num_attention_heads * head_dim(cfg)
        kv_size = cfg.num_key_value_heads * head_dim(cfg)
        parts = {
            "qkv_proj": [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)],
            "gate_up_proj": [("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)],
        }
        super().load_weights(split_fused(weights, parts))

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        """A rope type other than default and longrope never gets here: ``Phi3Config`` refuses it."""
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            return [f"hidden_act {hf_config.hidden_act!r} is not supported (SwiGLU only)"]
        return []

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        """Phi-3-mini-128k's and Phi-4-mini's quirks at once (GQA, tied head, half of each head
        rotated, LongRoPE factors, a 32-token window on every layer; every test sequence stays
        within ``original_max_position_embeddings``, where the short factors and the attention
        factor of a 4x extension apply), and Phi-4's plain shape (MHA, untied, full rotary,
        default rope, no window)."""
        tiny = dict(
            model_type="phi3",
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
            "Phi3ForCausalLM": dict(
                **tiny,
                num_key_value_heads=2,
                tie_word_embeddings=True,
                sliding_window=32,
                partial_rotary_factor=0.5,
                original_max_position_embeddings=64,
                rope_scaling={
                    "type": "longrope",
                    "short_factor": [1.0, 1.3, 1.9, 2.6],
                    "long_factor": [1.1, 2.5, 6.0, 11.0],
                },
            ),
            "Phi3ForCausalLM-plain": dict(**tiny, num_key_value_heads=4, tie_word_embeddings=False),
        }
