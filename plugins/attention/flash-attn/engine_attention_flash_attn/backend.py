"""FlashAttention on CUDA, by one of two paths over the block-major paged cache
[2, blocks, block_size, kv_heads, head_dim] (the layout FlashAttention's paged kernels read):

- ``flash_attn``: the ``flash_attn`` package's ``flash_attn_varlen_func`` reading the cache
  in place through the block table (with soft-cap and window). Its paged kernels take a block
  size that is a multiple of 256.
- ``torch``: PyTorch's bundled FlashAttention kernel (``aten._flash_attention_forward``, the
  varlen op behind ``scaled_dot_product_attention``'s flash backend) over each request's keys
  gathered from the paged cache into one ragged [keys, kv_heads, head_dim] tensor per layer
  (``key_slots``, built once per step). It has no soft-cap.

Both take grouped-query heads natively and align the causal mask to the bottom right (a
chunk's queries are the last positions of its keys), and a sliding window as (window - 1, 0).
Which path runs, and why the other does not, is :meth:`FlashAttnBackend.describe`; when
neither can, ``supports`` gives both paths' reasons. Nothing here imports ``flash_attn``
until a forward runs on that path.
"""

from __future__ import annotations

import functools
import importlib.util

import attrs
import torch

from engine.interfaces import AttentionBackend, AttentionSpec, BatchLayout, head_layout_reasons

PACKAGE, BUNDLED = "flash_attn", "torch"
_PATH_NAMES = {PACKAGE: "the flash_attn package", BUNDLED: "PyTorch's bundled flash kernel"}
_PAGE_MULTIPLE = 256


def device_reasons(platform) -> list[str]:
    """Why neither path can run on ``platform`` (both need a CUDA device of compute capability 8.0+)."""
    if platform.device_type != "cuda":
        return [f"FlashAttention runs on the cuda platform only (this is {platform.name})"]
    if not torch.cuda.is_available():
        return ["torch reports no CUDA device"]
    major, minor = torch.cuda.get_device_capability()
    return (
        [] if major >= 8 else [f"compute capability {major}.{minor} < 8.0 (FlashAttention 2 needs Ampere+)"]
    )


def spec_reasons(spec: AttentionSpec) -> list[str]:
    """What neither path supports in ``spec``."""
    reasons = []
    if spec.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"dtype {spec.dtype} (FlashAttention takes float16 or bfloat16)")
    if spec.head_dim % 8 or spec.head_dim > 256:
        reasons.append(f"head size {spec.head_dim} (a multiple of 8 up to 256)")
    return reasons + head_layout_reasons(spec)


def path_reasons(spec: AttentionSpec) -> dict[str, list[str]]:
    """Per path, what keeps it from serving ``spec`` beyond the device and the spec's common limits."""
    package = []
    if importlib.util.find_spec("flash_attn") is None:
        package.append("the flash_attn package is not installed")
    if spec.block_size % _PAGE_MULTIPLE:
        package.append(
            f"its paged kernels need a block size that is a multiple of {_PAGE_MULTIPLE} "
            f"(this is {spec.block_size})"
        )
    bundled = [] if spec.logit_softcap is None else ["it has no logit soft-cap"]
    return {PACKAGE: package, BUNDLED: bundled}


@functools.cache
def _varlen_func():
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


@attrs.frozen
class FlashMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32: keys each request attends (the torch path: those gathered)
    max_query_len: int
    max_key_len: int
    block_table: torch.Tensor  # [B, blocks] int32 (the package path)
    key_slots: torch.Tensor | None  # [keys] int64: cache slot of every gathered key (the torch path)


def key_slots(layout: BatchLayout, block_size: int, first_keys: list[int]) -> torch.Tensor:
    """Cache slots of request b's keys at positions [first_keys[b], seq_len_b), requests in
    order, computed on the layout's device without a sync."""
    device = layout.block_table.device
    counts = [n - f for n, f in zip(layout.seq_lens_host, first_keys)]
    total = sum(counts)
    lengths = torch.tensor(counts, device=device)
    request = torch.repeat_interleave(torch.arange(len(counts), device=device), lengths, output_size=total)
    starts = torch.tensor([0, *counts[:-1]], device=device).cumsum(0)
    offsets = torch.tensor(first_keys, device=device)
    position = torch.arange(total, device=device) - starts[request] + offsets[request]
    blocks = layout.block_table[request, position // block_size].long()
    return blocks * block_size + position % block_size


class FlashAttnBackend(AttentionBackend):
    name = "flash-attn"

    @classmethod
    def path(cls, spec: AttentionSpec) -> str | None:
        """The path that runs ``spec`` (the package first), None when neither can."""
        return next((p for p, reasons in path_reasons(spec).items() if not reasons), None)

    @classmethod
    def supports(cls, spec: AttentionSpec, platform) -> list[str]:
        common = device_reasons(platform) + spec_reasons(spec)
        if common or cls.path(spec):
            return common
        return [f"{_PATH_NAMES[p]}: {r}" for p, reasons in path_reasons(spec).items() for r in reasons]

    @classmethod
    def describe(cls, spec: AttentionSpec, platform) -> str | None:
        """Which path runs and why the other does not (None when the backend cannot run)."""
        if cls.supports(spec, platform):
            return None
        chosen = cls.path(spec)
        other = BUNDLED if chosen == PACKAGE else PACKAGE
        why = "; ".join(path_reasons(spec)[other]) or "the package path is preferred"
        return f"{_PATH_NAMES[chosen]} (not {_PATH_NAMES[other]}: {why})"

    def __init__(self, spec: AttentionSpec, platform, registry=None):
        super().__init__(spec, platform, registry)
        self.chosen_path = self.path(spec)

    def first_keys(self, layout: BatchLayout) -> list[int]:
        """Per request the first key its earliest query sees (0 without a window)."""
        window = self.spec.sliding_window
        if window is None:
            return [0] * layout.num_requests
        return [max(0, n - q - window + 1) for n, q in zip(layout.seq_lens_host, layout.query_lens)]

    def build_metadata(self, layout: BatchLayout) -> FlashMetadata:
        device = layout.block_table.device
        gather = self.chosen_path == BUNDLED
        firsts = self.first_keys(layout) if gather else [0] * layout.num_requests
        keys = [n - f for n, f in zip(layout.seq_lens_host, firsts)]
        cu_k = torch.tensor([0, *keys], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
        return FlashMetadata(
            layout.slot_mapping,
            layout.query_start_loc,
            cu_k,
            max(layout.query_lens),
            max(keys),
            layout.block_table,
            key_slots(layout, self.spec.block_size, firsts) if gather else None,
        )

    def window_size(self) -> tuple[int, int]:
        window = self.spec.sliding_window
        return (-1, -1) if window is None else (window - 1, 0)

    def forward(self, query, key, value, kv_cache, metadata: FlashMetadata) -> torch.Tensor:
        s = self.spec
        flat = kv_cache.view(2, -1, s.num_kv_heads, s.head_dim)
        flat.index_copy_(1, metadata.slot_mapping, torch.stack([key, value]))
        if query.stride(-1) != 1:
            query = query.contiguous()
        left, right = self.window_size()
        if metadata.key_slots is None:
            return _varlen_func()(
                query,
                kv_cache[0],
                kv_cache[1],
                metadata.cu_seqlens_q,
                metadata.cu_seqlens_k,
                metadata.max_query_len,
                metadata.max_key_len,
                softmax_scale=s.scale,
                causal=s.causal,
                window_size=(left, right),
                softcap=s.logit_softcap or 0.0,
                block_table=metadata.block_table,
            )
        keys, values = (flat[i].index_select(0, metadata.key_slots) for i in (0, 1))
        window = {} if left < 0 else dict(window_size_left=left, window_size_right=right)
        return torch.ops.aten._flash_attention_forward(
            query,
            keys,
            values,
            metadata.cu_seqlens_q,
            metadata.cu_seqlens_k,
            metadata.max_query_len,
            metadata.max_key_len,
            0.0,
            s.causal,
            False,
            scale=s.scale,
            **window,
        )[0]
