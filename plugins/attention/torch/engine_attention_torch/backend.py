"""Paged attention with torch's scaled_dot_product_attention.

Per step, requests are grouped: all single-token (decode) rows form one batched group;
each multi-token (prefill chunk) request is its own group, so no query is padded. A
group's keys and values are gathered block-wise from the cache ([B, blocks, block_size])
and attended with a boolean mask (context length and causality). Grouped-query heads
are folded into the query axis — [B, kv_heads, group * q, D] against [B, kv_heads, L, D]
— so K/V are never repeated per query head.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from engine.interfaces import AttentionBackend, AttentionSpec, BatchLayout


@attrs.frozen
class Group:
    rows: torch.Tensor | slice  # rows of the flattened batch, request-major
    block_table: torch.Tensor  # [B, blocks]
    mask: torch.Tensor  # [B, 1, q, L] True where a query may attend
    num_queries: int  # q per request in this group


@attrs.frozen
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    groups: tuple[Group, ...]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    @classmethod
    def supports(cls, spec: AttentionSpec, platform) -> list[str]:
        reasons = []
        if spec.num_heads % spec.num_kv_heads:
            reasons.append(f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads")
        return reasons

    def build_metadata(self, layout: BatchLayout) -> TorchAttentionMetadata:
        bs = self.spec.block_size
        starts = layout.query_start_loc.tolist()
        decodes = [i for i, q in enumerate(layout.query_lens) if q == 1]
        groups = []
        if decodes:
            idx = torch.tensor(decodes, device=layout.block_table.device)
            groups.append(self._group(idx, [starts[i] for i in decodes], layout, 1, bs))
        for i, q in enumerate(layout.query_lens):
            if q > 1:
                idx = torch.tensor([i], device=layout.block_table.device)
                groups.append(self._group(idx, None, layout, q, bs, rows=slice(starts[i], starts[i] + q)))
        return TorchAttentionMetadata(layout.slot_mapping, tuple(groups))

    @staticmethod
    def _group(idx, row_list, layout: BatchLayout, q: int, bs: int, rows=None) -> Group:
        max_len = max(layout.seq_lens_host[i] for i in idx.tolist())
        num_blocks = -(-max_len // bs)
        table = layout.block_table[idx, :num_blocks]
        seq_lens = layout.seq_lens[idx].long()
        key_pos = torch.arange(num_blocks * bs, device=table.device)
        query_pos = seq_lens[:, None] - q + torch.arange(q, device=table.device)  # [B, q]
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # causal and within the context
        if rows is None:
            contiguous = row_list == list(range(row_list[0], row_list[0] + len(row_list)))
            rows = slice(row_list[0], row_list[0] + len(row_list)) if contiguous \
                else torch.tensor(row_list, device=table.device)
        return Group(rows, table, mask.unsqueeze(1), q)

    def forward(self, query, key, value, kv_cache, metadata: TorchAttentionMetadata) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        s = self.spec
        key_cache.view(-1, s.num_kv_heads, s.head_dim).index_copy_(0, metadata.slot_mapping, key)
        value_cache.view(-1, s.num_kv_heads, s.head_dim).index_copy_(0, metadata.slot_mapping, value)
        if len(metadata.groups) == 1 and isinstance(metadata.groups[0].rows, slice):
            return self._attend(query, key_cache, value_cache, metadata.groups[0])
        out = torch.empty_like(query)
        for group in metadata.groups:
            out[group.rows] = self._attend(query[group.rows], key_cache, value_cache, group)
        return out

    def _attend(self, query, key_cache, value_cache, group: Group) -> torch.Tensor:
        s = self.spec
        batch, q, g = group.block_table.shape[0], group.num_queries, s.num_heads // s.num_kv_heads
        keys = key_cache[group.block_table].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
        values = value_cache[group.block_table].flatten(1, 2).transpose(1, 2)
        # [B*q, H, D] -> [B, q, Hkv, g, D] -> [B, Hkv, g*q, D]
        queries = query.view(batch, q, s.num_kv_heads, g, s.head_dim).permute(0, 2, 3, 1, 4)
        queries = queries.reshape(batch, s.num_kv_heads, g * q, s.head_dim)
        mask = group.mask.expand(batch, g, q, group.mask.shape[-1]).reshape(batch, 1, g * q, -1)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=s.scale)
        out = out.view(batch, s.num_kv_heads, g, q, s.head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(batch * q, s.num_heads, s.head_dim)
