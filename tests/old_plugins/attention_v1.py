"""An attention backend as written against interface v1 (release 1), frozen: paged attention in
plain torch that knows the v1 ``AttentionSpec`` (heads, head size, dtype, block size) and nothing
added since — it attends causally over the whole context with scale ``head_dim ** -0.5``. Handed
a sliding window, soft-capped logits, another query scale or bidirectional attention it would
attend wrongly without a word; the engine must never hand it one."""

import torch

from engine import hookimpl
from engine.interfaces import AttentionBackend


@hookimpl
def register_attention_backends(register):
    register("naive-v1", NaiveAttention, api=1)


class NaiveAttention(AttentionBackend):
    name = "naive-v1"

    @classmethod
    def supports(cls, spec, platform):
        if spec.num_heads % spec.num_kv_heads:
            return [f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads"]
        return []

    def forward(self, query, key, value, kv_cache, metadata):
        layout, spec = metadata, self.spec
        cache = kv_cache.view(2, -1, spec.num_kv_heads, spec.head_dim)  # [2, slots, kv heads, head size]
        cache[0, layout.slot_mapping] = key
        cache[1, layout.slot_mapping] = value
        out, start = torch.empty_like(query), 0
        for query_len, seq_len, table in zip(layout.query_lens, layout.seq_lens_host, layout.block_table):
            positions = torch.arange(seq_len, device=query.device)
            slots = table[positions // spec.block_size].long() * spec.block_size + positions % spec.block_size
            rows = slice(start, start + query_len)
            out[rows] = self._attend(query[rows], cache[:, slots], seq_len)
            start += query_len
        return out

    def _attend(self, q, kv, seq_len: int):
        group = self.spec.num_heads // self.spec.num_kv_heads
        keys, values = (t.repeat_interleave(group, dim=1).float() for t in kv)
        scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * self.spec.head_dim**-0.5
        query_pos = seq_len - q.shape[0] + torch.arange(q.shape[0], device=q.device)
        future = torch.arange(seq_len, device=q.device)[None, :] > query_pos[:, None]
        scores.masked_fill_(future, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
