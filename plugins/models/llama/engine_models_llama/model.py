"""Llama and the families with its shape: fused QKV and gate|up projections over the
flattened token axis, GQA, RoPE (incl. llama3 scaling), optional QKV bias (Qwen2) and
tied embeddings, sliding windows (Mistral's on every layer, Qwen2's on the layers from
``max_window_layers`` on), on the core's pre-norm decoder (:class:`engine.layers.DecoderForCausalLM`).
Parameter names follow Hugging Face's so checkpoints load as they are.
:class:`LlamaForSequenceClassification` is the same decoder as a classifier
(:class:`engine.layers.DecoderSequenceClassifier`)."""

from __future__ import annotations

from engine.interfaces import AttentionKind
from engine.layers import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderSequenceClassifier,
    GatedMLP,
)

SLIDING = "sliding_attention"


def qwen2_layer_types(cfg) -> list[str]:
    """Each layer's attention: the config's ``layer_types``, else ``transformers``' rule for
    Qwen2 — with ``use_sliding_window``, the layers from ``max_window_layers`` on slide."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    slides = getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)
    first = getattr(cfg, "max_window_layers", cfg.num_hidden_layers)
    return [SLIDING if slides and i >= first else "full_attention" for i in range(cfg.num_hidden_layers)]


class LlamaForCausalLM(DecoderForCausalLM):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
    tensor_parallel_capable = True  # DecoderAttention and GatedMLP blocks only

    def decoder_layer(self, cfg, index, method, dtype, ops):
        bias = getattr(cfg, "attention_bias", False)
        qwen2 = cfg.model_type == "qwen2"  # q/k/v biased, o not
        attention = DecoderAttention(
            cfg, index, method, dtype, ops, qkv_bias=bias or qwen2, o_bias=bias and not qwen2
        )
        mlp = GatedMLP(
            cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False), method, dtype, ops
        )
        return DecoderLayer(attention, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def layer_kinds(self) -> tuple[AttentionKind, ...]:
        """Mistral's ``sliding_window``, when set, applies to every layer; Qwen2's to the layers
        its ``layer_types`` mark ``sliding_attention``."""
        cfg = self.cfg
        window = getattr(cfg, "sliding_window", None)
        if not window or cfg.model_type not in ("mistral", "qwen2"):
            return ()
        if cfg.model_type == "mistral":
            return (AttentionKind(sliding_window=window),) * cfg.num_hidden_layers
        return tuple(
            AttentionKind(sliding_window=window if kind == SLIDING else None)
            for kind in qwen2_layer_types(cfg)
        )

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        tiny = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        return {
            "LlamaForCausalLM": dict(model_type="llama", **tiny, tie_word_embeddings=False),
            "LlamaForCausalLM-llama3-rope-tied": dict(
                model_type="llama",
                **tiny,
                tie_word_embeddings=True,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
            "MistralForCausalLM": dict(model_type="mistral", **tiny, sliding_window=None),
            "MistralForCausalLM-sliding-window": dict(model_type="mistral", **tiny, sliding_window=16),
            "Qwen2ForCausalLM": dict(model_type="qwen2", **tiny, tie_word_embeddings=False),
            "Qwen2ForCausalLM-sliding-window-layers": dict(
                model_type="qwen2",
                **{**tiny, "num_hidden_layers": 3},
                tie_word_embeddings=True,
                use_sliding_window=True,
                sliding_window=16,
                max_window_layers=1,
            ),
        }


class LlamaForSequenceClassification(DecoderSequenceClassifier, LlamaForCausalLM):
    """Hugging Face's ``*ForSequenceClassification`` of the Llama shape: a ``score`` head on the
    last token (or vLLM's ``classifier_from_token`` recipe over the LM head)."""

    architectures = ("LlamaForSequenceClassification", "Qwen2ForSequenceClassification")
    tensor_parallel_capable = False  # the score head is not sharded

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        causal = LlamaForCausalLM.example_configs()
        return {
            "LlamaForSequenceClassification": dict(causal["LlamaForCausalLM"], num_labels=2),
            "Qwen2ForSequenceClassification": dict(causal["Qwen2ForCausalLM"], num_labels=1),
        }
