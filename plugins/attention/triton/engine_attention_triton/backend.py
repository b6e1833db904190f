"""Paged attention in Triton over the flattened ragged batch.

The cache is block-major — [2, blocks, block_size, kv_heads, head_dim], the layout
FlashAttention and FlashInfer (NHD) read — and this step's K/V are written through the slot
mapping with one ``index_copy_``. Per step ``build_metadata`` cuts the batch into tiles
(``kernel.py``): decode rows (one query each) in one launch of small tiles, prefill chunks
in a second launch of taller ones, so a mixed batch is two launches and a uniform one is one.
The tiles depend only on the query lengths, and the kernel bounds each tile's keys on the
device: metadata built for a decode batch of B requests stays valid when the layout's tensors
are overwritten with another decode batch of B (what a captured CUDA graph replays), hence
``cuda_graph_support = "decode-only"``.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import attrs
import torch

from engine.interfaces import AttentionBackend, AttentionSpec, BatchLayout, head_layout_reasons

# query rows × grouped query heads a tile holds: a decode tile is one row per request (its
# heads padded up to the 16 rows tl.dot needs on a GPU), a prefill tile 128 lanes
DECODE_LANES, PREFILL_LANES = 16, 128
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreted() -> bool:
    """Triton kernels run on CPU tensors only under its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on")


@functools.cache
def _kernel():
    """The kernel module, imported on first use (so listing the plugin imports no Triton)."""
    from engine_attention_triton import kernel

    return kernel.paged_attention_kernel


@attrs.frozen
class Launch:
    """One kernel launch: tile t is rows [tile_row[t], tile_row[t] + rows) of request tile_request[t]."""

    tile_request: torch.Tensor  # [tiles] int32
    tile_row: torch.Tensor  # [tiles] int32
    rows: int


@attrs.frozen
class TritonAttentionMetadata:
    layout: BatchLayout
    launches: tuple[Launch, ...]


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    cuda_graph_support = "decode-only"

    @classmethod
    def supports(cls, spec: AttentionSpec, platform) -> list[str]:
        reasons = []
        if importlib.util.find_spec("triton") is None:
            reasons.append("the triton package is not installed")
        if platform.device_type == "cpu" and not interpreted():
            reasons.append("on the cpu platform Triton kernels run only under TRITON_INTERPRET=1 (tests)")
        elif platform.device_type not in ("cpu", "cuda"):
            reasons.append(f"Triton has no kernels for {platform.device_type} devices here")
        elif platform.device_type == "cuda" and not torch.cuda.is_available():
            reasons.append("torch reports no CUDA device")
        if spec.dtype not in _DTYPES:
            reasons.append(f"dtype {spec.dtype} (float16, bfloat16 or float32 only)")
        if not _power_of_two(spec.block_size) or spec.block_size < 16:
            reasons.append(
                f"block size {spec.block_size}: a power of two of at least 16 (a tl.dot dimension)"
            )
        if spec.head_dim > 256:
            reasons.append(f"head size {spec.head_dim} > 256")
        return reasons + head_layout_reasons(spec)

    def build_metadata(self, layout: BatchLayout) -> TritonAttentionMetadata:
        device = layout.block_table.device
        launches = []
        for decode, lanes in ((True, DECODE_LANES), (False, PREFILL_LANES)):
            rows = self.tile_rows(lanes)
            tiles = [
                (i, first)
                for i, q in enumerate(layout.query_lens)
                if (q == 1) == decode
                for first in range(0, q, rows)
            ]
            if tiles:
                requests, firsts = zip(*tiles)
                launches.append(
                    Launch(
                        torch.tensor(requests, dtype=torch.int32, device=device),
                        torch.tensor(firsts, dtype=torch.int32, device=device),
                        rows,
                    )
                )
        return TritonAttentionMetadata(layout, tuple(launches))

    def forward(self, query, key, value, kv_cache, metadata: TritonAttentionMetadata) -> torch.Tensor:
        s, layout = self.spec, metadata.layout
        kv_cache.view(2, -1, s.num_kv_heads, s.head_dim).index_copy_(
            1, layout.slot_mapping, torch.stack([key, value])
        )
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        table = layout.block_table
        for launch in metadata.launches:
            _kernel()[(launch.tile_request.shape[0], s.num_kv_heads)](
                out,
                query,
                kv_cache,
                table,
                layout.seq_lens,
                layout.query_start_loc,
                launch.tile_request,
                launch.tile_row,
                query.stride(0),
                query.stride(1),
                out.stride(0),
                out.stride(1),
                kv_cache.stride(0),
                kv_cache.stride(1),
                kv_cache.stride(2),
                kv_cache.stride(3),
                table.stride(0),
                s.scale,
                s.logit_softcap or 0.0,
                s.sliding_window or 0,
                **self.constexprs(launch.rows),
            )
        return out

    def tile_rows(self, lanes: int) -> int:
        """Query rows per tile when a tile holds ``lanes`` rows × grouped query heads."""
        return max(1, lanes // triton_next_power_of_2(self.spec.num_heads // self.spec.num_kv_heads))

    def constexprs(self, rows: int) -> dict:
        """The kernel's compile-time parameters for a launch of ``rows``-row tiles."""
        s, group = self.spec, self.spec.num_heads // self.spec.num_kv_heads
        return dict(
            GROUP=group,
            GROUP_PAD=triton_next_power_of_2(group),
            ROWS=rows,
            HEAD_DIM=s.head_dim,
            HEAD_PAD=max(16, triton_next_power_of_2(s.head_dim)),
            BLOCK_SIZE=s.block_size,
            CAUSAL=s.causal,
            WINDOW=s.sliding_window is not None,
            SOFTCAP=s.logit_softcap is not None,
            F32_DOT=s.dtype == torch.float32 or interpreted(),
        )


def triton_next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n (``triton.next_power_of_2`` without importing Triton)."""
    return 1 << (n - 1).bit_length()
