# Frozen: the release-1 Llama of models-llama, unchanged but for this line and one wrapped (see __init__.py).
"""Llama and the families with its shape: fused QKV and gate|up projections over the
flattened token axis, GQA, RoPE (incl. llama3 scaling), optional QKV bias (Qwen2) and
tied embeddings. Parameter names follow Hugging Face's so checkpoints load as they are."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.interfaces import Model
from engine.interfaces.model import KVLayout
from engine.layers import Attention, Linear, RMSNorm, RotaryEmbedding, silu_and_mul

# checkpoint projection -> (fused parameter, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, cfg, layer: int, method, dtype, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            _head_dim(cfg),
        )
        qkv_bias = getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2"
        o_bias = getattr(cfg, "attention_bias", False) and cfg.model_type != "qwen2"
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], qkv_bias, method, dtype)
        self.o_proj = Linear(q_size, [cfg.hidden_size], o_bias, method, dtype)
        self.rotary = rotary
        self.attn = Attention(layer)
        self.sizes = (q_size, kv_size, kv_size)

    def forward(self, positions, hidden, step):
        q, k, v = self.qkv_proj(hidden).split(self.sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), step)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, method, dtype):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = Linear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias, method, dtype)
        self.down_proj = Linear(cfg.intermediate_size, [cfg.hidden_size], bias, method, dtype)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer: int, method, dtype, rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, layer, method, dtype, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, method, dtype)

    def forward(self, positions, hidden, residual, step):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, step)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, method, dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(cfg, cfg.max_position_embeddings, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, method, dtype, self.rotary) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids, positions, step):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, step)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(Model):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.hf_config
        self.cfg = cfg
        self.model = LlamaModel(cfg, ctx.linear_method, ctx.dtype)
        self.tied = getattr(cfg, "tie_word_embeddings", False)
        if not self.tied:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=ctx.dtype)

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        reasons = []
        if getattr(hf_config, "sliding_window", None) and (
            hf_config.model_type == "mistral" or getattr(hf_config, "use_sliding_window", False)
        ):
            reasons.append("sliding-window attention is not supported")
        return reasons

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
            "Qwen2ForCausalLM": dict(model_type="qwen2", **tiny, tie_word_embeddings=False),
        }

    def kv_layout(self) -> KVLayout:
        cfg = self.cfg
        return KVLayout(
            cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, _head_dim(cfg)
        )

    def forward(self, input_ids, positions, step):
        return self.model(input_ids, positions, step)

    def compute_logits(self, hidden):
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        missing = set(params)
        for name, tensor in weights:
            if "rotary_emb" in name or (self.tied and name == "lm_head.weight"):
                continue
            module_path, _, param_name = name.rpartition(".")
            parent, _, proj = module_path.rpartition(".")
            if proj in _FUSED:
                fused, shard = _FUSED[proj]
                modules[f"{parent}.{fused}"].load_shard(param_name, tensor, shard)
                missing.discard(f"{parent}.{fused}.{param_name}")
            elif isinstance(modules.get(module_path), Linear):
                modules[module_path].load_shard(param_name, tensor)
                missing.discard(name)
            elif name in params:
                params[name].data.copy_(tensor)
                missing.discard(name)
            else:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")
        if missing:
            raise ValueError(f"checkpoint lacks {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")
