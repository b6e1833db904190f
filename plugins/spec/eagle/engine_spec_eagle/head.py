"""The EAGLE head in the published Hugging Face layout (EAGLE-1): ``fc`` maps
[token embedding ; target feature] (2H) to H, then one Llama decoder layer without an input
norm (``layers.0.*``), and the target's own LM head. Token embeddings come from the target."""

from __future__ import annotations

import glob
import os

import torch
from safetensors.torch import load_file
from torch import nn

from engine.interfaces.model import KVLayout
from engine.layers import Attention, Linear, RMSNorm, RotaryEmbedding, apply_rotary, silu_and_mul

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class EagleHead(nn.Module):
    def __init__(self, cfg, target, method, dtype):
        super().__init__()
        h = cfg.hidden_size
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or h // self.heads
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.sizes = (q, kv, kv)
        self.fc = nn.Linear(2 * h, h, bias=getattr(cfg, "bias", True), dtype=dtype)
        self.qkv_proj = Linear(h, [q, kv, kv], getattr(cfg, "attention_bias", False), method, dtype)
        self.o_proj = Linear(q, [h], False, method, dtype)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.gate_up_proj = Linear(h, [cfg.intermediate_size] * 2, False, method, dtype)
        self.down_proj = Linear(cfg.intermediate_size, [h], False, method, dtype)
        self.rotary = RotaryEmbedding(cfg, cfg.max_position_embeddings, dtype)
        self.attn = Attention(0)
        self._target = [target]

    def kv_layout(self) -> KVLayout:
        return KVLayout(1, self.heads, self.kv_heads, self.head_dim)

    def forward(self, input_ids, positions, step, features):
        x = self.fc(torch.cat([self._target[0].embed(input_ids), features.to(self.fc.weight.dtype)], dim=-1))
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q, k = apply_rotary(q.view(-1, self.heads, self.head_dim), k.view(-1, self.kv_heads, self.head_dim),
                            self.rotary(positions))
        attn = self.attn(q, k, v.view(-1, self.kv_heads, self.head_dim), step)
        hidden = self.o_proj(attn.reshape(-1, self.heads * self.head_dim)) + x
        return self.down_proj(silu_and_mul(self.gate_up_proj(self.post_attention_layernorm(hidden)))) + hidden

    def compute_logits(self, hidden):
        return self._target[0].compute_logits(hidden)

    def load(self, folder: str) -> None:
        files = glob.glob(os.path.join(folder, "*.safetensors"))
        if not files:
            raise ValueError(f"speculative_config: no *.safetensors EAGLE weights in {folder!r}")
        own = dict(self.named_parameters())
        missing = {n for n in own if not n.startswith("rotary")}
        for file in files:
            for name, tensor in load_file(file).items():
                if name == "embed_tokens.weight":  # the target's embeddings are used
                    continue
                base = name.removeprefix("layers.0.").removeprefix("self_attn.").removeprefix("mlp.")
                module, _, param = base.rpartition(".")
                if module in _FUSED:
                    fused, shard = _FUSED[module]
                    getattr(self, fused).load_shard(param, tensor, shard)
                    missing.discard(f"{fused}.{param}")
                elif base in own:
                    own[base].data.copy_(tensor)
                    missing.discard(base)
                elif isinstance(getattr(self, module, None), Linear):
                    getattr(self, module).load_shard(param, tensor)
                    missing.discard(base)
                else:
                    raise ValueError(f"EAGLE checkpoint tensor {name!r} matches nothing in the head")
        if missing:
            raise ValueError(f"EAGLE checkpoint lacks {sorted(missing)}")
