"""LayerOps: the small ops between a layer's matmuls, in plain torch.

At batch 1 a decoded token spends as long on these (residual add + RMSNorm, rotary
embedding, SwiGLU: ~15 torch calls per layer, each run cold after the weight matmuls) as
on the matmuls themselves; W8A8's activation quantization and int32 rescale cost as much
as its int8 matmul saves. A platform may return a subclass from ``Platform.layer_ops()``
with fused kernels for any of them; model plugins call them through ``ctx.layer_ops``.
Every override must match these methods within the dtype's rounding (the conformance kit
``engine.testing.layer_ops`` checks it) and may fall back to them for inputs it does not
take.

Inputs an op is documented to *consume* may be overwritten in place: the caller passes
tensors it owns (fresh matmul outputs, its residual stream) and does not read them after.

A platform may also hold group-affine weights (:class:`engine.layers.group_affine.AffineWeight`,
the form GGUF blocks take) in its own kernel: :meth:`LayerOps.pack_affine`. The plain ops have
none, and quant methods then keep their own path (torch's int4pack planes). Plain weights may
be prepacked too (:meth:`LayerOps.pack_dense`): on a CPU that computes bfloat16, bfloat16
weights go into oneDNN's blocked layout. FP4 weights with a float scale per block
(:class:`engine.layers.fp4.Fp4Weight`, NVFP4's form) may run on a platform's FP4 kernel
(:meth:`LayerOps.pack_fp4`); the plain ops have none, and the quant method dequantizes them.

LoRA adapters run as two grouped ops over a batch whose rows belong to different adapter slots
(punica's shrink and expand, :meth:`LayerOps.lora_shrink`, :meth:`LayerOps.lora_expand`), added
to whatever the base matmul computed (:mod:`engine.layers.lora`).

Mamba2 layers run two ops over the per-request state slots (models v4, :mod:`engine.layers.ssm`):
:meth:`LayerOps.causal_conv1d` and :meth:`LayerOps.ssm_scan`. Each request of a step continues
from its slot (a later prefill chunk, a decode step) or starts from zero (its first chunk).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

from engine.layers import ssm
from engine.layers.module import Layer


class LayerOps:
    name = "torch"
    # Whether every op gives a row the same bits whatever other rows share its call (a row
    # computed from that row alone, on a path the row count never changes). Ops that declare it
    # run under ``--batch-invariant``; elsewhere that mode takes these plain torch ops, which
    # compute row by row on every path. A subclass declares it for its own kernels.
    row_invariant: bool = False

    def pack_dense(self, weight: torch.Tensor) -> Layer | None:
        """A plain weight [N, K] prepacked for this platform's matmul, or None (the caller keeps
        ``F.linear``): a :class:`engine.layers.Layer` with ``forward(x, bias=None)`` = x · wᵀ
        (+ bias) in x's dtype, and ``dequantize()`` -> w [N, K], exact. ``forward`` sums in float32
        at least, in an order of its own, and rounds once: ``F.linear``'s result within float32
        summation order (platforms v3; ``engine.testing.layer_ops`` checks it). It may declare
        ``invariant_rows`` as :meth:`pack_affine`'s layer may. Here: oneDNN's blocked layout for
        bfloat16 weights on a CPU that computes bfloat16 (:mod:`engine.layers.dense`), which
        gives ``F.linear``'s bits (and declares nothing: its blocking follows the row count)."""
        from engine.layers.dense import PackedDense, packable

        return PackedDense(weight) if packable(weight) else None

    def pack_affine(self, weight) -> Layer | None:
        """``weight`` (an :class:`~engine.layers.group_affine.AffineWeight` [N, K]) packed for
        this platform's quantized matmul, or None when it has none for this weight (its group
        size, bit width, device) — the caller then keeps its own kernel. The result is a
        :class:`engine.layers.Layer` with ``forward(x)`` = x [M, K] · wᵀ -> [M, N] and
        ``rows(ids)`` = w[ids] -> [..., K] (embedding lookups), both in this ops' dtype, and
        ``dequantize()`` -> w [N, K]; its tensors are registered buffers. ``rows`` and
        ``dequantize`` are exact; ``forward`` may round the activations (e.g. to int8 per
        group of inputs), within the tolerance ``engine.testing.layer_ops`` checks. It may also
        offer ``logits(x)`` -> float32 [M, N], the same product with the activations rounded
        finer, which quant methods call for a vocabulary table's LM head (its error reaches the
        logits with no normalization after), ``prepare_logits()``, which they call once
        for such a table before its first ``logits``: the platform may make a copy of the
        table that its logits read (reported by :meth:`notes`), and ``greedy(x)`` -> int64
        [M] or None: each row's first maximum of ``logits(x)`` (NaN counting as the maximum),
        the same token, found without the logits where it can (None: not here; the caller
        takes the logits' argmax). Quant methods call it for a step whose rows all decode
        greedily (``QuantMethod.apply_greedy``). And it may declare ``invariant_rows``: the
        most rows a call of ``forward``, ``logits`` or ``greedy`` may take and still give each
        row the bits it gets alone (None: any number), which ``--batch-invariant`` then relies
        on (``engine.testing.layer_ops`` checks it), and ``invariant_at_any_rows()`` -> the
        layer with every row count on one path (``invariant_rows`` None), which quant methods
        call under that mode before anything else (``engine.layers.batch_invariant.invariant_packing``)."""
        return None

    def pack_affine_blocks(self, parts: list[torch.Tensor], layout: str) -> Layer | None:
        """The weight held by ``parts`` (a fused layer's projections, stacked along the outputs),
        each uint8 [rows, bytes per row] blocks in a named layout (``"ggml:q4_0"``,
        ``"ggml:q4_1"``, ``"ggml:q8_0"``: GGUF's bytes as the file stores them), packed as
        :meth:`pack_affine` packs the same weight but straight from the blocks: unpacking a
        GGUF model to group-affine tensors first is most of its load. None when this platform
        reads no such layout; the caller then unpacks for :meth:`pack_affine`."""
        return None

    def pack_fp4(self, weight) -> Layer | None:
        """``weight`` (an :class:`~engine.layers.fp4.Fp4Weight` [N, K]: e2m1 codes, a float32
        scale per block of inputs) packed for this platform's FP4 matmul, or None when it has
        none for this weight — the caller then dequantizes it. The result is a
        :class:`engine.layers.Layer` with ``forward(x)`` = x [M, K] · wᵀ -> [M, N] in this ops'
        dtype and ``dequantize()`` -> w [N, K], exact; ``forward`` computes in float32 from the
        activations as they are (no rounding of x), within float32 summation order
        (``engine.testing.layer_ops`` checks it). Optional: a platform without it keeps this None."""
        return None

    def notes(self, model) -> list[str]:
        """Lines for the start-up report about what these ops made of ``model``'s weights
        (which kernels run them, copies kept beside them and their memory); none here."""
        return []

    def rms_norm(self, norm, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm`` (an :class:`engine.layers.RMSNorm`: ``weight``, ``eps``) of x, or
        (norm(x + residual), x + residual) when a residual is given — then x and residual
        are consumed; without one, x is left as it is.

        On the CPU ``rms_norm`` is a composite of seven small ops, ``layer_norm`` one fused
        kernel. The layer norm of [h, −h] has mean 0 and variance mean(h²), so its first
        half is exactly the RMS norm of h: a third of the time at batch 1 (6.6 against
        11.3 µs; 562 against 849 µs for 2048 tokens)."""
        if residual is not None:
            x = x + residual
            residual = x
        size = x.shape[-1]
        if norm.doubled_weight is not None and x.device.type == "cpu":
            mirrored = torch.cat([x, x.neg()], dim=-1)
            out = F.layer_norm(mirrored, (2 * size,), norm.doubled_weight, None, norm.eps)[..., :size]
        else:
            out = F.rms_norm(x, (size,), norm.weight, eps=norm.eps)  # float32 accumulation inside
        return out if residual is None else (out, residual)

    def gather_rows(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``table[ids]``: rows of ``table`` [N, ...] at int64 ``ids`` [T] -> [T, ...] (the rotary
        tables looked up by position); an id outside [0, N) raises IndexError."""
        return torch.index_select(table, 0, ids)

    def rotary_qkv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ):
        """A fused q|k|v projection [T, (H + 2·H_kv)·D] (consumed) -> rotated q [T, H, D],
        rotated k [T, H_kv, D] and v [T, H_kv, D]. ``cos_sin`` is
        :meth:`engine.layers.RotaryEmbedding.forward`'s ([cos, cos], [−sin, sin]), each
        [T, 1, D]. q and k are rotated together, in one pass over their joint view;
        rotate-half is a roll by D/2: three ops where split-and-concatenate takes eight."""
        qk, v = qkv.view(qkv.shape[0], -1, head_dim).split([num_heads + num_kv_heads, num_kv_heads], dim=1)
        q, k = _rotate(qk, cos_sin).split([num_heads, num_kv_heads], dim=1)
        return q, k, v

    def partial_rotary_qkv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        interleaved: bool = False,
    ):
        """:meth:`rotary_qkv` where the rotation covers only the first R dims of each q and k
        head, R the tables' width (``partial_rotary_factor``: Phi-4-mini, GLM-4); the other
        dims pass through. ``interleaved``: R/2 pairs (x[2i], x[2i+1]) turn by angle i (GLM's
        GPT-J layout) rather than the halves' pairs (x[i], x[i + R/2]). qkv [T, (H + 2·H_kv)·D]
        is consumed (rotated in place) -> q [T, H, D], k [T, H_kv, D], v [T, H_kv, D]."""
        heads = qkv.view(qkv.shape[0], -1, head_dim)
        rotated = heads[:, : num_heads + num_kv_heads, : cos_sin[0].shape[-1]]
        rotated.copy_(_rotate_pairs(rotated, cos_sin) if interleaved else _rotate(rotated, cos_sin))
        return heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)

    def qk_norm_rotary(
        self,
        qkv: torch.Tensor,
        q_norm,
        k_norm,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ):
        """:meth:`rotary_qkv` with a per-head RMSNorm of q and k before the rotation (Qwen3,
        Qwen3-MoE): ``q_norm`` and ``k_norm`` are :class:`engine.layers.RMSNorm` s of size
        ``head_dim``, applied to every head. A fused q|k|v projection [T, (H + 2·H_kv)·D]
        (consumed; its rows may be padded) -> q [T, H, D], k [T, H_kv, D], v [T, H_kv, D]."""
        q, k, v = qkv.view(qkv.shape[0], -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        qk = torch.cat([self.rms_norm(q_norm, q), self.rms_norm(k_norm, k)], dim=1)
        q, k = _rotate(qk, cos_sin).split([num_heads, num_kv_heads], dim=1)
        return q, k, v

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU of a fused gate|up projection [T, 2·I] (consumed) -> [T, I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def quantize_rows_int8(self, x: torch.Tensor, outlier_threshold: float):
        """Dynamic per-row int8 of activations x [M, K] (W8A8) -> (xq int8 [M, K], scale float32
        [M, 1], outliers: int64 indices of the input channels where some |x| exceeds
        ``outlier_threshold``). Outlier channels are left out: zero in xq and not counted in
        a row's abs-max; the caller multiplies them in float. xq·scale ≈ x elsewhere, each
        value rounded half to even from x / scale."""
        magnitude = x.abs()  # abs-max in the activation dtype: one float pass fewer
        outliers = (magnitude.amax(dim=0) > outlier_threshold).nonzero().flatten()
        if outliers.numel():
            magnitude.index_fill_(1, outliers, 0)
        scale = magnitude.amax(dim=-1, keepdim=True).float().clamp_(min=1e-12).div_(127)
        scaled = x / scale  # float32; |scaled| <= 127 by construction
        if outliers.numel():
            scaled.index_fill_(1, outliers, 0)
        return scaled.round_().to(torch.int8), scale, outliers

    def rescale_int32(
        self, acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """An int32 matmul result [M, N] times row_scale [M, 1] and col_scale [1, N]
        (float32), in ``dtype``."""
        return acc.float().mul_(row_scale).mul_(col_scale).to(dtype)

    def lora_shrink(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        scale: torch.Tensor,
        indices: torch.Tensor,
        ranks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The first half of a batch of LoRA deltas. x [T, K] (not consumed); ``a`` [S, n, R, K]:
        per slot, the A of each of the layer's n fused output shards (rows past an adapter's rank
        are zero); ``scale`` [S, n] float32; ``indices`` int64 [T], each row's slot in [0, S) or
        -1 for none; ``ranks`` int64 [S, n] or None (all R): the rows of each A its adapter fills,
        which a kernel may read alone -> h [T, n, R] in x's dtype: scale[s, i] · A[s, i] · x for
        a row of slot s, zero for a row of none. Rows are grouped by slot, one matmul per slot in
        the batch (the zero rows included: a matmul over fewer rows would cost a copy)."""
        n, rank = a.shape[1:3]

        def shrink(part: torch.Tensor, slot: int) -> torch.Tensor:
            return (part @ a[slot].flatten(0, 1).T).view(-1, n, rank).mul_(scale[slot].to(x.dtype)[:, None])

        groups = list(_slot_rows(indices))
        if len(groups) == 1 and groups[0][1] is None:  # one slot has every row
            return shrink(x, groups[0][0])
        h = x.new_zeros(x.shape[0], n, rank)
        for slot, rows in groups:
            h.index_copy_(0, rows, shrink(x.index_select(0, rows), slot))
        return h

    def lora_expand(
        self,
        y: torch.Tensor,
        h: torch.Tensor,
        b: torch.Tensor,
        indices: torch.Tensor,
        output_sizes: tuple[int, ...],
    ) -> torch.Tensor:
        """The second half: y [T, N] (a matmul's output, consumed: added to in place) plus
        B[s, i] · h[:, i] on each fused shard i's columns (``output_sizes`` their widths, N in
        all) for a row of slot s; ``b`` [S, R, N]: B transposed, column j output j's B against
        its shard's rank; h [T, n, R] from :meth:`lora_shrink`; rows of none (-1) are left as
        they are. Returns y."""
        bounds = list(itertools.accumulate(output_sizes, initial=0))
        shards = list(enumerate(itertools.pairwise(bounds)))
        for slot, rows in _slot_rows(indices):
            if rows is None:  # every row: add in place, shard by shard
                for i, (lo, hi) in shards:
                    y[:, lo:hi].addmm_(h[:, i], b[slot, :, lo:hi])
                return y
            part = h.index_select(0, rows)
            delta = torch.cat([part[:, i] @ b[slot, :, lo:hi] for i, (lo, hi) in shards], dim=1)
            y.index_add_(0, rows, delta.to(y.dtype))
        return y

    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_states: torch.Tensor,
        layout: Any,
    ) -> torch.Tensor:
        """A Mamba2 layer's causal depthwise convolution and SiLU over a step's rows x [T, C]
        (weight [C, K]), each request continuing from the last K-1 inputs in its state slot
        (``conv_states`` [slots, C, K-1], float32: read, then replaced); ``layout`` is the state
        group's (:class:`engine.runner.layer_attention.StateSlots`). -> [T, C] in x's dtype."""
        return ssm.causal_conv1d(x, weight, bias, conv_states, layout)

    def ssm_scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        params: ssm.SSMParams,
        ssm_states: torch.Tensor,
        layout: Any,
    ) -> torch.Tensor:
        """A Mamba2 layer's selective scan with its D skip: x [T, H, P], dt [T, H] (before
        ``dt_bias`` and softplus), B and C [T, G, N] -> y [T, H, P] in x's dtype, each request
        continuing from its slot's SSM state (``ssm_states`` [slots, H, P, N], float32: read,
        then replaced by the state after its last row). Matches ``transformers``' Mamba2 scan:
        its chunked form for a prefill chunk, its recurrence for one row."""
        return ssm.ssm_scan(x, dt, B, C, params, ssm_states, layout)


def _slot_rows(indices: torch.Tensor):
    """(slot, int64 row numbers) for each slot some row uses, rows of none (-1) skipped; the
    rows are None when one slot has them all (no gather or scatter needed)."""
    slots = torch.unique(indices).tolist()
    if slots == [-1]:
        return
    if len(slots) == 1:
        yield slots[0], None
        return
    for slot in slots:
        if slot >= 0:
            yield slot, (indices == slot).nonzero().flatten()


def _rotate(heads: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half RoPE of heads [T, N, D] with ([cos, cos], [−sin, sin]) [T, 1, D]."""
    cos, sin = cos_sin
    return torch.addcmul(heads * cos, heads.roll(heads.shape[-1] // 2, -1), sin)


def _rotate_pairs(heads: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Interleaved RoPE of heads [T, N, R]: pair i, (x[2i], x[2i + 1]), turned by angle i of
    the rotate-half tables ([cos, cos], [−sin, sin]) [T, 1, R]."""
    half = heads.shape[-1] // 2
    cos, sin = cos_sin[0][..., :half], cos_sin[1][..., half:]
    even, odd = heads[..., 0::2], heads[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
