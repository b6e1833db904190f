"""FlashInfer's paged attention on CUDA, with its plan/run split.

The cache is block-major, [2, blocks, block_size, kv_heads, head_dim]: its two halves are
FlashInfer's NHD page tables for K and V, passed as a (k, v) tuple. ``build_metadata`` turns
the step's :class:`BatchLayout` into FlashInfer's page arguments (:func:`page_arguments`:
qo/kv indptr, page indices, last page lengths) and plans once per step — the decode wrapper
when every request has one query row, the prefill wrapper (which takes decode rows too)
otherwise; every layer's ``forward`` then only runs. A wrapper holds one plan, so metadata is
valid until the backend builds the next; ``forward`` refuses a stale one.

``flashinfer`` is imported when the first plan is made; without it, or without the nvcc its
JIT needs (and no prebuilt kernel package), ``supports`` says so.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
import shutil

import attrs
import torch

from engine.interfaces import AttentionBackend, AttentionSpec, BatchLayout, head_layout_reasons

WORKSPACE_BYTES = 128 << 20  # FlashInfer's scratch for split-KV partial results
HEAD_DIMS = (64, 128, 256)
_IDS = itertools.count()


def toolchain_reasons() -> list[str]:
    """Why FlashInfer's kernels cannot be had here: the package, and the nvcc its JIT compiles
    kernels with unless prebuilt ones (``flashinfer_jit_cache``) are installed."""
    if importlib.util.find_spec("flashinfer") is None:
        return ["the flashinfer package is not installed"]
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    has_nvcc = shutil.which("nvcc") or os.path.exists(os.path.join(cuda_home, "bin", "nvcc"))
    if not has_nvcc and importlib.util.find_spec("flashinfer_jit_cache") is None:
        return ["no nvcc for FlashInfer's JIT (and no prebuilt flashinfer-jit-cache kernels)"]
    return []


@attrs.frozen
class PageArguments:
    """FlashInfer's view of a batch: request b's queries are rows qo_indptr[b]:qo_indptr[b+1],
    its pages kv_indices[kv_indptr[b]:kv_indptr[b+1]], the last holding last_page_len[b] tokens."""

    qo_indptr: torch.Tensor  # [B + 1] int32, host
    kv_indptr: torch.Tensor  # [B + 1] int32, host
    kv_indices: torch.Tensor  # [pages] int32, the layout's device
    last_page_len: torch.Tensor  # [B] int32, host


def page_arguments(layout: BatchLayout, block_size: int) -> PageArguments:
    """From the layout's host lengths (no device sync) and its block table."""
    pages = [-(-n // block_size) for n in layout.seq_lens_host]
    device = layout.block_table.device
    request = torch.repeat_interleave(
        torch.arange(len(pages), device=device), torch.tensor(pages, device=device), output_size=sum(pages)
    )
    first_page = torch.tensor([0, *itertools.accumulate(pages)][:-1], device=device)
    column = torch.arange(sum(pages), device=device) - first_page[request]
    return PageArguments(
        qo_indptr=torch.tensor([0, *itertools.accumulate(layout.query_lens)], dtype=torch.int32),
        kv_indptr=torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32),
        kv_indices=layout.block_table[request, column].to(torch.int32),
        last_page_len=torch.tensor(
            [n - (p - 1) * block_size for n, p in zip(layout.seq_lens_host, pages)], dtype=torch.int32
        ),
    )


@attrs.frozen
class FlashInferMetadata:
    slot_mapping: torch.Tensor
    wrapper: object  # the planned FlashInfer wrapper
    plan_id: int


@functools.cache
def _flashinfer():
    import flashinfer

    return flashinfer


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    @classmethod
    def supports(cls, spec: AttentionSpec, platform) -> list[str]:
        if platform.device_type != "cuda":
            reasons = [f"FlashInfer runs on the cuda platform only (this is {platform.name})"]
        elif not torch.cuda.is_available():
            reasons = ["torch reports no CUDA device"]
        else:
            reasons = []
        reasons += toolchain_reasons()
        if spec.dtype not in (torch.float16, torch.bfloat16):
            reasons.append(f"dtype {spec.dtype} (FlashInfer takes float16 or bfloat16)")
        if spec.head_dim not in HEAD_DIMS:
            reasons.append(f"head size {spec.head_dim} (one of {', '.join(map(str, HEAD_DIMS))})")
        return reasons + head_layout_reasons(spec)

    def __init__(self, spec: AttentionSpec, platform, registry=None):
        super().__init__(spec, platform, registry)
        self._wrappers: dict[str, object] = {}
        self._plan_id = -1

    def _wrapper(self, kind: str, device: torch.device):
        """The decode or prefill wrapper, made on first use over one shared workspace."""
        if kind not in self._wrappers:
            fi = _flashinfer()
            if "workspace" not in self._wrappers:
                self._wrappers["workspace"] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            cls = (
                fi.BatchDecodeWithPagedKVCacheWrapper
                if kind == "decode"
                else fi.BatchPrefillWithPagedKVCacheWrapper
            )
            self._wrappers[kind] = cls(self._wrappers["workspace"], kv_layout="NHD")
        return self._wrappers[kind]

    def build_metadata(self, layout: BatchLayout) -> FlashInferMetadata:
        s, args = self.spec, page_arguments(layout, self.spec.block_size)
        common = dict(
            sm_scale=s.scale,
            window_left=-1 if s.sliding_window is None else s.sliding_window - 1,
            logits_soft_cap=s.logit_softcap,
            q_data_type=s.dtype,
            kv_data_type=s.dtype,
        )
        pages = (args.kv_indptr, args.kv_indices, args.last_page_len)
        if all(q == 1 for q in layout.query_lens) and s.causal:
            wrapper = self._wrapper("decode", layout.block_table.device)
            wrapper.plan(*pages, s.num_heads, s.num_kv_heads, s.head_dim, s.block_size, **common)
        else:
            wrapper = self._wrapper("prefill", layout.block_table.device)
            wrapper.plan(
                args.qo_indptr,
                *pages,
                s.num_heads,
                s.num_kv_heads,
                s.head_dim,
                s.block_size,
                causal=s.causal,
                **common,
            )
        self._plan_id = next(_IDS)
        return FlashInferMetadata(layout.slot_mapping, wrapper, self._plan_id)

    def forward(self, query, key, value, kv_cache, metadata: FlashInferMetadata) -> torch.Tensor:
        if metadata.plan_id != self._plan_id:
            raise RuntimeError("FlashInfer metadata from an earlier step: its wrapper has been planned again")
        s = self.spec
        kv_cache.view(2, -1, s.num_kv_heads, s.head_dim).index_copy_(
            1, metadata.slot_mapping, torch.stack([key, value])
        )
        return metadata.wrapper.run(query.contiguous(), (kv_cache[0], kv_cache[1]))
