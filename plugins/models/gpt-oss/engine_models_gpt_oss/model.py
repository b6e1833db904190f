"""gpt-oss (``GptOssForCausalLM``) on the core's decoder.

Attention: the core's :class:`engine.layers.DecoderAttention` with biased q|k|v and o
projections and a learned sink logit per query head (``self_attn.sinks``): each layer's kind
declares ``AttentionKind.sinks``, so only attention backends that honour sinks serve it. Layers
alternate between a sliding window (``config.layer_types`` "sliding_attention", window
``config.sliding_window``) and full attention. The rotary tables are YaRN's as
``rope_parameters`` say (``truncate`` included): the core takes them from ``transformers``' own
initialisers.

Feed-forward: every layer is a mixture of experts (:mod:`.experts`). With an MXFP4 checkpoint
(``quantization_config.quant_method`` "mxfp4", as gpt-oss ships) only the experts are MXFP4 and
stay packed in the quant method's storage; attention, router, embeddings and LM head are float
tensors there and are kept in the activation dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.interfaces import AttentionKind
from engine.layers import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    Layer,
    LayerOps,
    UnquantizedLinearMethod,
    decoder_rename,
    load_checkpoint,
)
from engine_models_gpt_oss.experts import GptOssMoE, per_expert_tensors

SLIDING = "sliding_attention"
# quant methods whose gpt-oss checkpoints quantize the experts only
EXPERTS_ONLY_QUANT = ("mxfp4",)


def dense_method(method):
    """The linear method of everything but the experts: the checkpoint's method, unless it is
    one that quantizes gpt-oss's experts only (then the activation dtype)."""
    return UnquantizedLinearMethod(method.ctx) if method.name in EXPERTS_ONLY_QUANT else method


class GptOssForCausalLM(DecoderForCausalLM):
    """Under tensor parallelism the attention splits by KV-head groups (each rank hands the
    backend its heads' sinks) and the experts by intermediate slice (each rank every expert's
    gate and up rows, down columns; the down biases added on rank 0; the router replicated):
    the core's :class:`engine.layers.FusedMoE` split, one all-reduce per layer's experts."""

    architectures = ("GptOssForCausalLM",)
    tensor_parallel_capable = True

    def decoder_layer(self, cfg, index: int, method, dtype, ops: LayerOps) -> Layer:
        dense = dense_method(method)
        bias = cfg.attention_bias
        attention = DecoderAttention(cfg, index, dense, dtype, ops, qkv_bias=bias, o_bias=bias, sinks=True)
        mlp = GptOssMoE(cfg, method, dtype, ops)
        return DecoderLayer(attention, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def layer_kinds(self) -> tuple[AttentionKind, ...]:
        """Every layer has sinks; "sliding_attention" layers also the config's window."""
        window = self.cfg.sliding_window
        return tuple(
            AttentionKind(sliding_window=window if kind == SLIDING else None, sinks=True)
            for kind in self.cfg.layer_types
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, per_expert_tensors(weights), decoder_rename(self.tied))

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        reasons = []
        kinds = set(getattr(hf_config, "layer_types", None) or [])
        if kinds - {SLIDING, "full_attention"}:
            reasons.append(f"layer_types {sorted(kinds)}: only sliding_attention and full_attention")
        quant = (getattr(hf_config, "quantization_config", None) or {}).get("quant_method")
        if quant not in (None, *EXPERTS_ONLY_QUANT):
            reasons.append(f"quantization_config quant_method {quant!r}: bf16/float or mxfp4 experts only")
        return reasons

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        """gpt-oss-20b's shape, shrunk: GQA 4:1 heads of 16, a sliding and a full
        layer, YaRN with gpt-oss's own parameters (truncate off), top-2 of 4 experts."""
        return {
            "GptOssForCausalLM": dict(
                model_type="gpt_oss",
                vocab_size=256,
                hidden_size=64,
                intermediate_size=64,
                head_dim=16,
                num_hidden_layers=2,
                num_attention_heads=8,
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=8,
                max_position_embeddings=256,
                rope_parameters=dict(
                    rope_type="yarn",
                    rope_theta=5000.0,
                    factor=4.0,
                    beta_fast=32.0,
                    beta_slow=1.0,
                    truncate=False,
                    original_max_position_embeddings=64,
                ),
                swiglu_limit=1.5,
                tie_word_embeddings=False,
            ),
        }
