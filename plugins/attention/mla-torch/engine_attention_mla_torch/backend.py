"""Multi-head latent attention (MLA) over a paged latent cache, in plain PyTorch.

The cache holds one vector per token, ``[blocks, block_size, kv_lora_rank + rope_dim]``
(``block_dim = 0``): the normalized latent, then the rotated key part every head shares. Per
step the requests split in two paths, as vLLM's MLA backends split them:

- decode rows (a request with one query row) go through the **absorbed** path: the key
  up-projection is folded into the query (``q_nope @ W_UK`` -> one ``kv_lora_rank`` query per
  head) and the value up-projection applied after the softmax, so attention runs on the latent
  pages as they are — per token ``kv_lora_rank + rope_dim`` numbers are read, not ``H`` keys and
  values. Decode rows are batched over one padded block table with a mask.
- the other requests (prefill chunks, drafts being verified) go through the **naive** path:
  the cached latents of the context are decompressed into per-head K/V with the up-projection
  and attended by the fused causal kernel, where a chunk's many queries amortize the
  decompression.

``decode_path = "naive"`` sends decode rows down the naive path too (the same attention,
computed another way: the model tests compare the two). ``path_rows`` counts the query rows
each path was given, per step's metadata. Both paths compute in float32 whatever the cache's
dtype: this is the reference backend, and on CPUs without bf16 matmul units float32 is also the
faster (bf16 ``bmm`` was 6-7x slower than converting and multiplying in float32 on an AVX2
machine).
"""

from __future__ import annotations

from collections import Counter

import attrs
import torch
import torch.nn.functional as F

from engine.interfaces import PAGED_LATENT, AttentionBackend, AttentionSpec, BatchLayout, LatentUpProjection

PATHS = ("absorbed", "naive")


@attrs.frozen
class AbsorbedGroup:
    """The decode rows of a step, one per request."""

    rows: torch.Tensor  # [B] rows of the flattened batch
    block_table: torch.Tensor  # [B, blocks], padded with the null block
    bias: torch.Tensor  # [B, 1, blocks * block_size] float32: 0 inside the context, -inf past it


@attrs.frozen
class NaiveGroup:
    """One request's query rows over its context."""

    rows: slice
    blocks: torch.Tensor  # [blocks] of the request
    seq_len: int
    mask: torch.Tensor | None  # [q, seq_len] for a chunk after a cached prefix; None: whole sequence


@attrs.frozen
class MLAMetadata:
    slot_mapping: torch.Tensor
    absorbed: AbsorbedGroup | None
    naive: tuple[NaiveGroup, ...]


class MLATorchBackend(AttentionBackend):
    name = "mla-torch"
    block_dim = 0
    cache_layouts = (PAGED_LATENT,)

    def __init__(self, spec: AttentionSpec, platform, registry=None, decode_path: str = "absorbed"):
        super().__init__(spec, platform, registry=registry)
        if decode_path not in PATHS:
            raise ValueError(f"decode_path: {decode_path!r} is not one of {', '.join(PATHS)}")
        self.decode_path = decode_path
        self.path_rows: Counter[str] = Counter()

    @classmethod
    def supports(cls, spec: AttentionSpec, platform) -> list[str]:
        reasons = []
        if spec.sliding_window is not None:
            reasons.append("a sliding window")
        if spec.logit_softcap is not None:
            reasons.append("logit soft-capping")
        if not spec.causal:
            reasons.append("bidirectional attention")
        return reasons

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        latent = self.spec.latent
        if latent is None:
            raise ValueError("mla-torch: the spec declares no paged latent layout")
        return (num_blocks, self.spec.block_size, latent.entry_dim)

    def build_metadata(self, layout: BatchLayout) -> MLAMetadata:
        starts = layout.query_start_loc.tolist()
        absorb = self.decode_path == "absorbed"
        decodes = [i for i, q in enumerate(layout.query_lens) if q == 1 and absorb]
        naive = tuple(
            self._naive_group(i, slice(starts[i], starts[i] + q), layout)
            for i, q in enumerate(layout.query_lens)
            if i not in decodes
        )
        self.path_rows["absorbed"] += len(decodes)
        self.path_rows["naive"] += sum(g.rows.stop - g.rows.start for g in naive)
        absorbed = self._absorbed_group(decodes, [starts[i] for i in decodes], layout) if decodes else None
        return MLAMetadata(layout.slot_mapping, absorbed, naive)

    def _absorbed_group(self, requests: list[int], rows: list[int], layout: BatchLayout) -> AbsorbedGroup:
        device, bs = layout.block_table.device, self.spec.block_size
        seq_lens = torch.tensor([layout.seq_lens_host[i] for i in requests], device=device)
        num_blocks = -(-int(seq_lens.max()) // bs)
        table = layout.block_table[torch.tensor(requests, device=device), :num_blocks]
        inside = torch.arange(num_blocks * bs, device=device)[None, :] < seq_lens[:, None]
        bias = torch.zeros(inside.shape, device=device).masked_fill_(~inside, float("-inf"))
        return AbsorbedGroup(torch.tensor(rows, device=device), table, bias[:, None, :])

    def _naive_group(self, request: int, rows: slice, layout: BatchLayout) -> NaiveGroup:
        seq_len, q = layout.seq_lens_host[request], layout.query_lens[request]
        blocks = layout.block_table[request, : -(-seq_len // self.spec.block_size)]
        prefix = seq_len - q
        mask = None
        if prefix:
            device = layout.block_table.device
            keys = torch.arange(seq_len, device=device)[None, :]
            mask = keys <= prefix + torch.arange(q, device=device)[:, None]
        return NaiveGroup(rows, blocks, seq_len, mask)

    def forward(self, query, key, value, kv_cache, metadata) -> torch.Tensor:
        raise NotImplementedError("mla-torch reads the paged latent layout only: call forward_latent")

    def forward_latent(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: MLAMetadata,
        up: LatentUpProjection,
    ) -> torch.Tensor:
        entries = torch.cat([latent, k_rope], dim=-1).to(kv_cache.dtype)
        kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, metadata.slot_mapping, entries)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], up.value.shape[1])
        if metadata.absorbed is not None:
            group = metadata.absorbed
            out[group.rows] = self._absorbed(q_nope[group.rows], q_rope[group.rows], kv_cache, group, up)
        for group in metadata.naive:
            out[group.rows] = self._naive(q_nope[group.rows], q_rope[group.rows], kv_cache, group, up)
        return out

    def _absorbed(self, q_nope, q_rope, kv_cache, group: AbsorbedGroup, up: LatentUpProjection):
        """[B, H, *] decode rows over their latent pages in place: scores against the latent
        with W_UK folded into the query, W_UV applied to the attended latent."""
        rank = up.key.shape[2]
        pages = kv_cache[group.block_table].flatten(1, 2).float()  # [B, L, rank + rope]
        q_latent = torch.bmm(q_nope.float().transpose(0, 1), up.key.float()).transpose(0, 1)
        scores = torch.baddbmm(
            group.bias,
            torch.cat([q_latent, q_rope.float()], dim=-1),
            pages.transpose(1, 2),
            alpha=self.spec.scale,
        )
        attended = torch.bmm(scores.softmax(-1), pages[..., :rank])  # [B, H, rank]
        out = torch.bmm(attended.transpose(0, 1), up.value.float().transpose(1, 2))  # [H, B, v]
        return out.transpose(0, 1).to(q_nope.dtype)

    def _naive(self, q_nope, q_rope, kv_cache, group: NaiveGroup, up: LatentUpProjection):
        """[q, H, *] rows of one request: its context decompressed into per-head K/V."""
        rank, heads = up.key.shape[2], q_nope.shape[1]
        context = kv_cache[group.blocks].flatten(0, 1)[: group.seq_len].float()
        latent, k_rope = context[:, :rank], context[:, rank:]
        k_nope = torch.matmul(latent, up.key.float().transpose(1, 2))  # [H, S, nope]
        keys = torch.cat([k_nope, k_rope[None].expand(heads, -1, -1)], dim=-1)
        values = torch.matmul(latent, up.value.float().transpose(1, 2))  # [H, S, v]
        queries = torch.cat([q_nope, q_rope], dim=-1).float().transpose(0, 1)
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=group.mask,
            is_causal=group.mask is None,
            scale=self.spec.scale,
        )
        return out.transpose(0, 1).to(q_nope.dtype)
