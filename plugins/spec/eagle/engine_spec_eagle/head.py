"""EAGLE heads in their published Hugging Face layouts.

* EAGLE-1 (``fc.*``, ``layers.0.*``): ``fc`` maps [token embedding ; target feature] (2H) to
  H, then one Llama decoder layer without an input norm; the target's LM head.
* EAGLE-3 (``fc.*``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``): ``fc`` fuses the target's
  residual streams after three layers (3H) into H; the layer attends over
  [norm(embedding) ; norm(hidden)] (2H) and adds to ``hidden``; its own LM head covers a
  draft vocabulary mapped to target ids by ``d2t`` (target id = draft id + d2t[draft id]).
  Later draft steps feed the head's own output back as ``hidden``.
Token embeddings always come from the target.
"""

from __future__ import annotations

import glob
import os

import torch
from safetensors.torch import load_file
from torch import nn

from engine.interfaces import KVLayout
from engine.layers import Attention, LayerOps, Linear, RMSNorm, RotaryEmbedding, load_checkpoint


def checkpoint_tensors(folder: str) -> dict[str, torch.Tensor]:
    files = glob.glob(os.path.join(folder, "*.safetensors"))
    if not files:
        raise ValueError(f"speculative_config: no *.safetensors EAGLE weights in {folder!r}")
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


class _Head(nn.Module):
    layer_prefix: str
    ignored: tuple[str, ...] = ("embed_tokens.weight",)

    def __init__(self, cfg, target, method, dtype, input_size: int):
        super().__init__()
        h = cfg.hidden_size
        self.hidden_size = h
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or h // self.heads
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = Linear(input_size, [q, kv, kv], getattr(cfg, "attention_bias", False), method, dtype)
        self.o_proj = Linear(q, [h], False, method, dtype)
        self.ops = LayerOps()
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, self.ops)
        self.gate_up_proj = Linear(h, [cfg.intermediate_size] * 2, False, method, dtype)
        self.down_proj = Linear(cfg.intermediate_size, [h], False, method, dtype)
        self.rotary = RotaryEmbedding(cfg, cfg.max_position_embeddings, dtype)
        self.attn = Attention(0)
        self._target = [target]

    def kv_layout(self) -> KVLayout:
        return KVLayout(1, self.heads, self.kv_heads, self.head_dim)

    def _attend(self, x, positions, step):
        q, k, v = self.ops.rotary_qkv(
            self.qkv_proj(x), self.heads, self.kv_heads, self.head_dim, self.rotary(positions)
        )
        out = self.attn(q, k, v, step)
        return self.o_proj(out.reshape(-1, self.heads * self.head_dim))

    def _mlp(self, hidden):
        return (
            self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(self.post_attention_layernorm(hidden))))
            + hidden
        )

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        def rename(name: str) -> str | None:
            if name in self.ignored:
                return None
            return name.removeprefix(self.layer_prefix).removeprefix("self_attn.").removeprefix("mlp.")

        load_checkpoint(self, tensors.items(), rename)


class Eagle1Head(_Head):
    layer_prefix = "layers.0."

    def __init__(self, cfg, target, method, dtype):
        super().__init__(cfg, target, method, dtype, cfg.hidden_size)
        self.fc = nn.Linear(
            2 * cfg.hidden_size, cfg.hidden_size, bias=getattr(cfg, "bias", True), dtype=dtype
        )

    def forward(self, input_ids, positions, step, features):
        x = self.fc(torch.cat([self._target[0].embed(input_ids), features.to(self.fc.weight.dtype)], dim=-1))
        return self._mlp(self._attend(x, positions, step) + x)

    def compute_logits(self, hidden):
        return self._target[0].compute_logits(hidden)


class Eagle3Head(_Head):
    layer_prefix = "midlayer."
    ignored = ("embed_tokens.weight", "t2d")

    def __init__(self, cfg, target, method, dtype):
        h = cfg.hidden_size
        super().__init__(cfg, target, method, dtype, 2 * h)
        target_hidden = getattr(cfg, "target_hidden_size", None) or h
        draft_vocab = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
        self.fc = nn.Linear(3 * target_hidden, h, bias=False, dtype=dtype)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False, dtype=dtype)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.target_vocab = cfg.vocab_size

    def forward(self, input_ids, positions, step, features):
        features = features.to(self.fc.weight.dtype)
        hidden = self.fc(features) if features.shape[-1] != self.hidden_size else features
        embeds = self.input_layernorm(self._target[0].embed(input_ids))
        x = torch.cat([embeds, self.hidden_norm(hidden)], dim=-1)
        return self._mlp(self._attend(x, positions, step) + hidden)

    def compute_logits(self, hidden):
        draft = self.lm_head(self.norm(hidden)).float()
        logits = torch.full((hidden.shape[0], self.target_vocab), float("-inf"), device=hidden.device)
        ids = torch.arange(draft.shape[1], device=hidden.device) + self.d2t
        return logits.index_copy_(1, ids, draft)


def build_head(cfg, tensors, target, method, dtype) -> _Head:
    cls = Eagle3Head if any(name.startswith("midlayer.") for name in tensors) else Eagle1Head
    head = cls(cfg, target, method, dtype)
    head.load(tensors)
    return head
