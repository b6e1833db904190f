"""Qwen3 dense decoders on the core's pre-norm decoder (:class:`engine.layers.DecoderForCausalLM`):
Llama's shape (fused QKV and gate|up projections, GQA, RoPE, tied or untied LM head) plus a
per-head RMSNorm of q and k before the rotation, and a ``head_dim`` of its own (Qwen3's heads
are usually wider than hidden / heads). Parameter names follow Hugging Face's so checkpoints
load as they are. :class:`Qwen3ForSequenceClassification` is the same decoder as a classifier
or reranker (:class:`engine.layers.DecoderSequenceClassifier`)."""

from __future__ import annotations

from engine.layers import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderSequenceClassifier,
    GatedMLP,
)


class Qwen3ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen3ForCausalLM",)
    tensor_parallel_capable = True  # DecoderAttention and GatedMLP blocks only

    def decoder_layer(self, cfg, index, method, dtype, ops):
        bias = getattr(cfg, "attention_bias", False)
        attention = DecoderAttention(cfg, index, method, dtype, ops, qkv_bias=bias, o_bias=bias, qk_norm=True)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, method, dtype, ops)
        return DecoderLayer(attention, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        if getattr(hf_config, "use_sliding_window", False) and getattr(hf_config, "sliding_window", None):
            return ["sliding-window attention (use_sliding_window) is not supported"]
        return []

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        """Qwen3's own shape (head_dim wider than hidden / heads, GQA, tied head as the
        small Qwen3 checkpoints have), an untied one with 4 q heads per KV head, and one
        without GQA whose head_dim is hidden / heads."""
        tiny = dict(
            model_type="qwen3",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            max_position_embeddings=256,
        )
        return {
            "Qwen3ForCausalLM": dict(
                **tiny, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True
            ),
            "Qwen3ForCausalLM-untied-gqa4": dict(
                **tiny, num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False
            ),
            "Qwen3ForCausalLM-mha-narrow-heads": dict(
                **tiny,
                num_attention_heads=4,
                num_key_value_heads=4,
                head_dim=16,
                tie_word_embeddings=False,
                rope_theta=10000.0,
            ),
        }


class Qwen3ForSequenceClassification(DecoderSequenceClassifier, Qwen3ForCausalLM):
    """Hugging Face's (a ``score`` head on the last token), or a Qwen3 causal LM scoring with
    its "no"/"yes" logits under vLLM's ``--hf-overrides`` recipe (the Qwen3 reranker)."""

    architectures = ("Qwen3ForSequenceClassification",)
    tensor_parallel_capable = False  # the score head is not sharded

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        causal = Qwen3ForCausalLM.example_configs()["Qwen3ForCausalLM-untied-gqa4"]
        return {
            "Qwen3ForSequenceClassification": dict(causal, num_labels=1),
            "Qwen3ForSequenceClassification-3-labels": dict(causal, num_labels=3),
        }
