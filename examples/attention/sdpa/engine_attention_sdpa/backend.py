"""The backend: write this step's K/V into the paged cache, then attend per request.

The cache is the default layout, ``[2, num_blocks, block_size, kv_heads, head_dim]`` (keys,
then values). Each request's context is gathered from its blocks and handed to
``torch.nn.functional.scaled_dot_product_attention`` with a causal mask offset to the
request's last ``query_len`` positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.interfaces import AttentionBackend, AttentionSpec, BatchLayout, Platform

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class SdpaAttentionBackend(AttentionBackend):
    name = "sdpa"

    @classmethod
    def supports(cls, spec: AttentionSpec, platform: Platform) -> list[str]:
        reasons = []
        if spec.num_heads % spec.num_kv_heads:
            reasons.append(f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads")
        if spec.dtype not in DTYPES:
            reasons.append(f"dtype {spec.dtype} is not one of {', '.join(map(str, DTYPES))}")
        if not spec.causal:
            reasons.append("attends causally only")
        if spec.sliding_window is not None or spec.logit_softcap is not None:
            reasons.append("no sliding window or logit soft-cap (Gemma's layers get another backend)")
        if spec.sinks:
            reasons.append("no attention sinks (gpt-oss's layers get another backend)")
        return reasons

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: BatchLayout,
        sinks: torch.Tensor | None = None,  # never given: supports() refuses sinks
    ) -> torch.Tensor:
        keys, values = kv_cache[0], kv_cache[1]  # [blocks, block_size, kv_heads, head_dim], views
        keys.view(-1, *keys.shape[2:]).index_copy_(0, metadata.slot_mapping, key)
        values.view(-1, *values.shape[2:]).index_copy_(0, metadata.slot_mapping, value)
        out = torch.empty_like(query)
        start = 0
        for row, (query_len, seq_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens_host)):
            blocks = metadata.block_table[row, : -(-seq_len // self.spec.block_size)].long()
            k = keys[blocks].flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, head_dim]
            v = values[blocks].flatten(0, 1)[:seq_len]
            q = query[start : start + query_len]
            causal = torch.ones(query_len, seq_len, dtype=torch.bool, device=query.device).tril(
                seq_len - query_len
            )
            attended = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=causal,
                scale=self.spec.scale,
                enable_gqa=True,
            )
            out[start : start + query_len] = attended.transpose(0, 1)
            start += query_len
        return out
