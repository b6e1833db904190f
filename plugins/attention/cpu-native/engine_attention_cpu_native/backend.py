"""Paged attention in C for the CPU, reading KV blocks in place through the block table.

The cache layout is the torch backend's — [2, kv_heads, blocks, block_size, head_dim] —
so a (KV head, block) is one contiguous block_size × head_dim tile the kernel reads where
it lies, and chunks can go to the torch backend's fused (flash) path over the same cache
without converting anything. By default every query row of a step — decode rows, speculative
verification, prompt chunks of any length — is attended by one C call (``attention.c``), whose
work items are fixed tiles of 16 rows: a row's result then depends on its own query and context
only, never on how its prompt was chunked, whether its prefix came from the prefix cache, or
what else shares the step (``chunk_invariant``, ``batch_invariant_capable``). A subclass that
sets ``max_native_query_len`` hands longer chunks to the torch backend, obtained through the
plugin registry, as a batch of their own, and gives those guarantees up.

Attention sinks (``spec.sinks``, gpt-oss) cost the kernel one more term in each row's final
softmax denominator: it takes the layer's per-head sink logits as a float32 array.

An fp8 cache (``--kv-cache-dtype fp8``, ``fp8_e5m2``) is read in place by the same kernel built
for its bytes, widening them to float32 in registers, and written by ``write_kv_fp8``, which
stores K/V divided by the layer's scales, byte for byte as ``engine.interfaces.quantize_kv``.
A float16 cache (``--kv-cache-dtype float16``) goes the same way (``write_kv_f16``): for float32
activations, the bytes of a bf16 cache with 3 more mantissa bits.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import attrs
import torch

from engine.interfaces import AttentionBackend, AttentionSpec, BatchLayout, KVScale, quantize_kv
from engine.interfaces.attention import build_backend
from engine.native import Library, load_source
from engine.native.tape import NativeKernel, bind
from engine_attention_cpu_native.sub_layout import Delegated, delegate

SOURCE = Path(__file__).with_name("attention.c")
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# the caches it reads beside the activation dtype, widened to float32 as it reads them
_WIDENED = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.float16: "f16"}


@functools.cache
def library() -> Library:
    """attention.c built once per machine (``engine.native``, typed by ``attention.h``) and
    loaded once per process; raises its ``BuildError`` when it cannot be built."""
    return load_source(SOURCE)


@functools.cache
def kv_writer() -> NativeKernel:
    """The C scatter of a step's K/V into the cache (one call where torch takes a stack, a
    transpose and an index_copy_)."""
    return bind(library(), "write_kv")


@functools.cache
def fp8_writer() -> NativeKernel:
    """The C scatter of a step's K/V into an fp8 cache, quantizing as it goes."""
    return bind(library(), "write_kv_fp8")


@functools.cache
def f16_writer() -> NativeKernel:
    """The C scatter of a step's K/V into a float16 cache, rounding as it goes."""
    return bind(library(), "write_kv_f16")


@functools.cache
def kernel(dtype: torch.dtype, portable: bool = False, cache: torch.dtype | None = None) -> NativeKernel:
    """The C entry point for activations of ``dtype`` over a cache of ``cache`` (None: the
    same dtype; or an fp8 or float16 one): AVX-512 where built for it, or the portable C one
    (``portable``). Both are recordable onto native tapes."""
    stored = f"_{_WIDENED[cache]}" if cache is not None else ""
    return bind(library(), f"paged_attention_{_SUFFIX[dtype]}{stored}{'_scalar' if portable else ''}")


@attrs.frozen
class NativeGroup:
    """The requests the C kernel attends, as the int32 arrays it reads."""

    requests: torch.Tensor  # [R] int32: indices into the batch
    query_start: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, blocks] int32, contiguous


@attrs.frozen
class NativeAttentionMetadata:
    slot_mapping: torch.Tensor
    native: NativeGroup | None
    delegated: Delegated | None


class NativeAttentionBackend(AttentionBackend):
    name = "cpu-native"
    block_dim = 2
    # None: every row in C. An int: requests with more query rows go to the torch backend's
    # flash path, which sums in another order, so a row's bits would depend on its chunk's
    # length (a subclass that sets it must declare chunk_invariant and batch_invariant_capable
    # False). Flash was ahead for chunks over 8 rows when a request was one C work item; with
    # 16-row tiles the C kernel splits a prompt over the threads as well.
    max_native_query_len: int | None = None
    chunk_invariant = True
    batch_invariant_capable = True
    portable = False  # the portable C kernel even where the AVX-512 one is built (tests)
    # decode steps read the layout's lengths and block table when the kernel runs
    # (build_graph_metadata), and attend in C alone: the cpu-native platform tapes them
    cuda_graph_support = "decode-only"
    kv_cache_dtypes = tuple(_WIDENED)

    @classmethod
    def supports(cls, spec: AttentionSpec, platform) -> list[str]:
        reasons = []
        if platform.device_type != "cpu":
            reasons.append(f"runs on the CPU, not {platform.device_type}")
        if spec.dtype not in _SUFFIX:
            reasons.append(f"takes bfloat16 and float32 caches, not {spec.dtype}")
        if spec.num_heads % spec.num_kv_heads:
            reasons.append(f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads")
        if not spec.causal:
            reasons.append("attends causally only (no bidirectional attention for encoder models)")
        try:
            lib = library()
        except (ImportError, OSError, RuntimeError) as error:
            return [*reasons, f"cannot build its C kernel: {error}"]
        if spec.head_dim % 16 or spec.head_dim > lib.max_head_dim():
            reasons.append(f"head_dim {spec.head_dim} is not a multiple of 16 up to {lib.max_head_dim()}")
        if spec.block_size > lib.max_block_size():
            reasons.append(f"block_size {spec.block_size} is over {lib.max_block_size()}")
        return reasons

    def __init__(self, spec: AttentionSpec, platform, registry=None):
        super().__init__(spec, platform, registry)
        self._kernel = kernel(spec.dtype, self.portable, spec.kv_cache_dtype)
        self._torch = (
            None if self.max_native_query_len is None else build_backend(registry, "torch", spec, platform)
        )

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        s = self.spec
        return (2, s.num_kv_heads, num_blocks, s.block_size, s.head_dim)

    def build_metadata(self, layout: BatchLayout) -> NativeAttentionMetadata:
        limit = self.max_native_query_len
        short = [i for i, q in enumerate(layout.query_lens) if limit is None or q <= limit]
        long = [i for i, q in enumerate(layout.query_lens) if limit is not None and q > limit]
        native = self._native_group(layout, short) if short else None
        delegated = delegate(layout, long, layout.query_start_loc.tolist(), self._torch) if long else None
        return NativeAttentionMetadata(layout.slot_mapping.to(torch.int64).contiguous(), native, delegated)

    def build_graph_metadata(self, layout: BatchLayout) -> NativeAttentionMetadata:
        """A decode batch over a recorded step's static buffers: the kernel reads the layout's
        own query starts, lengths and block table (int32, contiguous) each time it runs."""
        if any(q != 1 for q in layout.query_lens):
            raise ValueError("cpu-native attention records decode steps only (one query row a request)")
        tensors = (layout.query_start_loc, layout.seq_lens, layout.block_table)
        if any(t.dtype != torch.int32 or not t.is_contiguous() for t in tensors):
            raise ValueError("a recorded step's layout must hold contiguous int32 lengths and block table")
        requests = torch.arange(layout.num_requests, dtype=torch.int32)
        return NativeAttentionMetadata(layout.slot_mapping, NativeGroup(requests, *tensors), None)

    def _native_group(self, layout: BatchLayout, requests: list[int]) -> NativeGroup:
        """Copies made now, from the host lengths: the layout's tensors may be the runner's
        buffers, which change before a later forward reads them (speculative steps did)."""
        query_start = torch.tensor([0, *itertools.accumulate(layout.query_lens)], dtype=torch.int32)
        return NativeGroup(
            torch.tensor(requests, dtype=torch.int32),
            query_start,
            torch.tensor(layout.seq_lens_host, dtype=torch.int32),
            layout.block_table.to(torch.int32, copy=True).contiguous(),
        )

    def forward(
        self,
        query,
        key,
        value,
        kv_cache,
        metadata: NativeAttentionMetadata,
        kv_scale: KVScale | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every row's K/V is written before anything attends: a request may read blocks that
        another request of the same step writes (a prompt prefix shared within the step). The
        torch backend writes the delegated rows again (the same values; those steps prefill)."""
        scale = kv_scale or KVScale()
        self._write_kv(key, value, kv_cache, metadata.slot_mapping, scale)
        out = torch.empty(query.shape, dtype=query.dtype)
        sinks = None if sinks is None else sinks.to(torch.float32).contiguous()
        if metadata.native is not None:
            self._attend_native(query, kv_cache, metadata.native, out, scale, sinks)
        if metadata.delegated is not None:
            rows = metadata.delegated.rows
            extra: dict = {"kv_scale": scale} if self.spec.kv_cache_dtype is not None else {}
            if sinks is not None:
                extra["sinks"] = sinks
            out[rows] = self._torch.forward(
                query[rows], key[rows], value[rows], kv_cache, metadata.delegated.metadata, **extra
            )
        return out

    def _write_kv(self, key, value, kv_cache, slot_mapping, scale: KVScale | None = None) -> None:
        s, scale = self.spec, scale or KVScale()
        if key.stride() != value.stride() or key.stride(2) != 1 or not kv_cache.is_contiguous():
            self._write_kv_torch(key, value, kv_cache, slot_mapping, scale)
            return
        slots = kv_cache.shape[2] * s.block_size
        rows = (
            key.data_ptr(),
            value.data_ptr(),
            key.stride(0),
            key.stride(1),
            slot_mapping.data_ptr(),
            key.shape[0],
            s.num_kv_heads,
            s.head_dim,
            slots,
        )
        if s.kv_cache_dtype == torch.float16:
            bf16 = int(key.dtype == torch.bfloat16)
            status = f16_writer()(*rows, bf16, scale.k, scale.v, kv_cache.data_ptr())
        elif s.kv_cache_dtype is not None:
            bf16, e5m2 = int(key.dtype == torch.bfloat16), int(s.kv_cache_dtype == torch.float8_e5m2)
            status = fp8_writer()(*rows, bf16, e5m2, scale.k, scale.v, kv_cache.data_ptr())
        else:
            status = kv_writer()(*rows, key.element_size(), kv_cache.data_ptr())
        if status:
            raise IndexError(f"cpu-native attention: a slot outside the cache's {slots}")

    def _write_kv_torch(self, key, value, kv_cache, slot_mapping, scale: KVScale) -> None:
        """The write for K/V views the C scatter does not take (or a cache not contiguous)."""
        s, stored = self.spec, self.spec.kv_cache_dtype
        if stored is not None:
            key, value = quantize_kv(key, stored, scale.k), quantize_kv(value, stored, scale.v)
        if stored is not None and stored.itemsize == 1:  # fp8 has no index_copy_ on the CPU: its bytes do
            key, value, kv_cache = key.view(torch.uint8), value.view(torch.uint8), kv_cache.view(torch.uint8)
        new_kv = torch.stack([key, value]).transpose(1, 2)  # [2, Hkv, T, D]: K and V in one write
        kv_cache.view(2, s.num_kv_heads, -1, s.head_dim).index_copy_(2, slot_mapping, new_kv)

    def _attend_native(
        self,
        query,
        kv_cache,
        group: NativeGroup,
        out: torch.Tensor,
        scale: KVScale,
        sinks: torch.Tensor | None,
    ) -> None:
        s = self.spec
        if query.stride(2) != 1 or query.stride(1) != s.head_dim:
            query = query.contiguous()
        status = self._kernel(
            query.data_ptr(),
            query.stride(0),
            kv_cache.data_ptr(),
            kv_cache.data_ptr() + kv_cache.stride(0) * kv_cache.element_size(),
            kv_cache.stride(1),
            group.block_table.data_ptr(),
            group.block_table.stride(0),
            group.query_start.data_ptr(),
            group.seq_lens.data_ptr(),
            group.requests.data_ptr(),
            group.requests.numel(),
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            s.block_size,
            s.scale * scale.k,
            s.sliding_window or 0,
            s.logit_softcap or 0.0,
            0 if sinks is None else sinks.data_ptr(),
            scale.v,
            out.data_ptr(),
        )
        if status:
            raise MemoryError("cpu-native attention: no memory for the kernel's scratch buffers")
