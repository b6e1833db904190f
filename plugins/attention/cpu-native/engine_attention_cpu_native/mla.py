"""Multi-head latent attention (MLA, DeepSeek-V2/V3) decode in C for the CPU, reading the paged
latent cache in place through the block table.

The cache layout is mla-torch's, ``[blocks, block_size, kv_lora_rank + rope_dim]`` (``block_dim
= 0``), so both read the same pages. Decode rows (a request with one query row) take the
absorbed path: the key up-projection is folded into the query in float32 (one ``kv_lora_rank``
query per head beside its rotary part), one C call (``mla.c``) attends every decode row's heads
over its latent pages where they lie, and the value up-projection is applied to the attended
latents. Prefill chunks and verified drafts go to the ``mla-torch`` backend's naive path
(decompression amortized over a chunk's rows), obtained through the plugin registry, as a batch
of their own over the same cache. ``decode_path = "naive"`` sends decode rows there too, and
``path_rows`` counts the rows each path was given, as on ``mla-torch``.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import attrs
import torch

from engine.interfaces import PAGED_LATENT, AttentionBackend, AttentionSpec, BatchLayout, LatentUpProjection
from engine.interfaces.attention import build_backend
from engine.native import Library, load_source
from engine.native.tape import NativeKernel, bind
from engine_attention_cpu_native.sub_layout import Delegated, delegate

SOURCE = Path(__file__).with_name("mla.c")
PATHS = ("absorbed", "naive")
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
LANES = 8  # the AVX2 math's vector width: the latent and rotary sizes are whole vectors


@functools.cache
def library() -> Library:
    """mla.c built once per machine (``engine.native``, typed by ``mla.h``) and loaded once per
    process; raises its ``BuildError`` when it cannot be built."""
    return load_source(SOURCE)


@functools.cache
def kernel(dtype: torch.dtype, portable: bool = False) -> NativeKernel:
    """The decode entry point for a cache of ``dtype``: AVX2 + FMA where built for it, or the
    portable C one (``portable``)."""
    return bind(library(), f"mla_decode_{_SUFFIX[dtype]}{'_scalar' if portable else ''}")


@attrs.frozen
class NativeDecodes:
    """The decode rows of a step, as the int32 arrays the C kernel reads."""

    rows: torch.Tensor  # [B] int64: rows of the flattened batch
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, blocks] int32, contiguous


@attrs.frozen
class MLANativeMetadata:
    slot_mapping: torch.Tensor
    native: NativeDecodes | None
    delegated: Delegated | None


class MLANativeBackend(AttentionBackend):
    name = "mla-cpu-native"
    block_dim = 0
    cache_layouts = (PAGED_LATENT,)
    portable = False  # the portable C kernel even where the AVX2 one is built (tests)

    @classmethod
    def supports(cls, spec: AttentionSpec, platform) -> list[str]:
        reasons = []
        if platform.device_type != "cpu":
            reasons.append(f"runs on the CPU, not {platform.device_type}")
        if spec.dtype not in _SUFFIX:
            reasons.append(f"takes bfloat16 and float32 caches, not {spec.dtype}")
        if spec.sliding_window is not None:
            reasons.append("a sliding window")
        if spec.logit_softcap is not None:
            reasons.append("logit soft-capping")
        if not spec.causal:
            reasons.append("bidirectional attention")
        latent = spec.latent
        if latent is not None and (latent.kv_lora_rank % LANES or latent.rope_dim % LANES):
            reasons.append(f"kv_lora_rank and rope_dim must be multiples of {LANES}")
        try:
            lib = library()
        except (ImportError, OSError, RuntimeError) as error:
            return [*reasons, f"cannot build its C kernel: {error}"]
        if latent is not None and latent.entry_dim > lib.mla_max_entry_dim():
            reasons.append(f"a latent vector of {latent.entry_dim} is over {lib.mla_max_entry_dim()}")
        if spec.block_size > lib.mla_max_block_size():
            reasons.append(f"block_size {spec.block_size} is over {lib.mla_max_block_size()}")
        return reasons

    def __init__(self, spec: AttentionSpec, platform, registry=None, decode_path: str = "absorbed"):
        super().__init__(spec, platform, registry=registry)
        if decode_path not in PATHS:
            raise ValueError(f"decode_path: {decode_path!r} is not one of {', '.join(PATHS)}")
        self.decode_path = decode_path
        self.path_rows: Counter[str] = Counter()
        self._kernel = kernel(spec.dtype, self.portable)
        self._reference = build_backend(registry, "mla-torch", spec, platform)
        self._reference.decode_path = "naive"  # it is handed no decode row unless naive is asked

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        latent = self.spec.latent
        if latent is None:
            raise ValueError("mla-cpu-native: the spec declares no paged latent layout")
        return (num_blocks, self.spec.block_size, latent.entry_dim)

    def build_metadata(self, layout: BatchLayout) -> MLANativeMetadata:
        absorb = self.decode_path == "absorbed"
        decodes = [i for i, q in enumerate(layout.query_lens) if q == 1 and absorb]
        others = [i for i in range(layout.num_requests) if i not in decodes]
        starts = layout.query_start_loc.tolist()
        self.path_rows["absorbed"] += len(decodes)
        self.path_rows["naive"] += sum(layout.query_lens[i] for i in others)
        return MLANativeMetadata(
            layout.slot_mapping,
            self._native(layout, decodes, starts) if decodes else None,
            delegate(layout, others, starts, self._reference) if others else None,
        )

    def _native(self, layout: BatchLayout, requests: list[int], starts: list[int]) -> NativeDecodes:
        index = torch.tensor(requests)
        return NativeDecodes(
            torch.tensor([starts[i] for i in requests]),
            torch.tensor([layout.seq_lens_host[i] for i in requests], dtype=torch.int32),
            layout.block_table[index].to(torch.int32).contiguous(),
        )

    def forward(self, query, key, value, kv_cache, metadata) -> torch.Tensor:
        raise NotImplementedError("mla-cpu-native reads the paged latent layout only: call forward_latent")

    def forward_latent(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: MLANativeMetadata,
        up: LatentUpProjection,
    ) -> torch.Tensor:
        """Every row's latent is written before anything attends (a request may read blocks
        another request of the step writes); mla-torch writes its rows again (the same values)."""
        entries = torch.cat([latent, k_rope], dim=-1).to(kv_cache.dtype)
        kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, metadata.slot_mapping, entries)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], up.value.shape[1])
        if metadata.native is not None:
            rows = metadata.native.rows
            out[rows] = self._absorbed(q_nope[rows], q_rope[rows], kv_cache, metadata.native, up)
        if metadata.delegated is not None:
            rows, inner = metadata.delegated.rows, metadata.delegated.metadata
            out[rows] = self._reference.forward_latent(
                q_nope[rows], q_rope[rows], latent[rows], k_rope[rows], kv_cache, inner, up
            )
        return out

    def _absorbed(self, q_nope, q_rope, kv_cache, group: NativeDecodes, up: LatentUpProjection):
        """[B, H, *] decode rows: W_UK folded into the query, the latent pages attended in C,
        W_UV applied to the attended latents (float32 throughout, as mla-torch)."""
        s, latent = self.spec, self.spec.latent
        assert latent is not None  # kv_cache_shape refused a spec without one
        if not kv_cache.is_contiguous():  # the kernel addresses blocks by their index
            raise ValueError("mla-cpu-native reads a contiguous latent cache only")
        q_latent = torch.bmm(q_nope.float().transpose(0, 1), up.key.float())  # [H, B, rank]
        query = torch.cat([q_latent.transpose(0, 1), q_rope.float()], dim=-1).contiguous()
        attended = torch.empty(query.shape[0], s.num_heads, latent.kv_lora_rank)
        status = self._kernel(
            query.data_ptr(),
            kv_cache.data_ptr(),
            group.block_table.data_ptr(),
            group.block_table.stride(0),
            group.seq_lens.data_ptr(),
            query.shape[0],
            s.num_heads,
            latent.kv_lora_rank,
            latent.rope_dim,
            s.block_size,
            s.scale,
            attended.data_ptr(),
        )
        if status:
            raise MemoryError("mla-cpu-native: no memory for the kernel's scratch buffers")
        out = torch.bmm(attended.transpose(0, 1), up.value.float().transpose(1, 2))  # [H, B, v]
        return out.transpose(0, 1).to(q_nope.dtype)
