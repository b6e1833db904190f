"""Planted bugs: platforms whose layer ops override one plain-torch op of
:class:`engine.layers.LayerOps` with a rewrite holding the mistake a platform author makes,
each in torch so no kernel is built (one models a C kernel not handed the row stride). Not
registered by the suite's conftest: ``tests/test_layer_ops_kit_mutations.py`` registers them in
a child pytest that runs the layer-ops kit on each, and checks that it fails."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import hookimpl
from engine.builtin.platforms import CpuPlatform
from engine.layers import LayerOps


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the authors below write it, in float32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class StaleResidual(LayerOps):
    """Adds the residual into x and normalizes it, but hands back the residual it was given."""

    def rms_norm(self, norm, x, residual=None):
        if residual is None:
            return super().rms_norm(norm, x)
        x.add_(residual)
        return _rms(x, norm.weight, norm.eps), residual


class EpsOutsideTheRoot(LayerOps):
    """Divides by ``sqrt(mean(x²)) + eps``, not ``sqrt(mean(x²) + eps)``: the same wherever rows
    are large next to eps."""

    def rms_norm(self, norm, x, residual=None):
        if residual is not None:
            x = residual = x + residual
        x32 = x.float()
        out = (x32 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + norm.eps) * norm.weight.float()).to(x.dtype)
        return out if residual is None else (out, residual)


class NormInPlace(LayerOps):
    """Normalizes x in place also without a residual, taking every input to be consumed."""

    def rms_norm(self, norm, x, residual=None):
        if residual is not None:
            return super().rms_norm(norm, x, residual)
        return x.copy_(_rms(x, norm.weight, norm.eps))


class RotateHalfTwice(LayerOps):
    """Transformers' ``rotate_half`` (−x₂, x₁) against the engine's sine table, which already
    holds the sign ([−sin, sin]): the sine is negated twice, k and q rotated backwards."""

    def rotary_qkv(self, qkv, num_heads, num_kv_heads, head_dim, cos_sin):
        cos, sin = cos_sin
        heads = qkv.view(qkv.shape[0], -1, head_dim)
        qk, v = heads.split([num_heads + num_kv_heads, num_kv_heads], dim=1)
        first, second = qk.chunk(2, dim=-1)
        rotated = qk * cos + torch.cat([-second, first], dim=-1) * sin
        q, k = rotated.split([num_heads, num_kv_heads], dim=1)
        return q, k, v


class UnstridedRotary(LayerOps):
    """Rotates q and k in place at row t·(H + 2·H_kv)·D, the row stride of a contiguous projection,
    as a kernel not handed ``qkv.stride(0)`` does: padded rows are read and written out of place."""

    def rotary_qkv(self, qkv, num_heads, num_kv_heads, head_dim, cos_sin):
        tokens, width = qkv.shape[0], (num_heads + 2 * num_kv_heads) * head_dim
        heads = qkv.as_strided((tokens, num_heads + num_kv_heads, head_dim), (width, head_dim, 1))
        heads.copy_(torch.addcmul(heads * cos_sin[0], heads.roll(head_dim // 2, -1), cos_sin[1]))
        return qkv.view(tokens, -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)


class PairsAsHalves(LayerOps):
    """Rotates a partial head's halves whatever ``interleaved`` says: a kernel written for
    Phi-3's layout, handed GLM's."""

    def partial_rotary_qkv(self, qkv, num_heads, num_kv_heads, head_dim, cos_sin, interleaved=False):
        return super().partial_rotary_qkv(qkv, num_heads, num_kv_heads, head_dim, cos_sin)


class SharedQkNorm(LayerOps):
    """Normalizes the k heads with ``q_norm``'s weight: the two are equal in a freshly
    initialized model."""

    def qk_norm_rotary(self, qkv, q_norm, k_norm, num_heads, num_kv_heads, head_dim, cos_sin):
        return super().qk_norm_rotary(qkv, q_norm, q_norm, num_heads, num_kv_heads, head_dim, cos_sin)


class SwappedSwiGLU(LayerOps):
    """Takes the fused projection as up|gate: SiLU of the second half times the first."""

    def silu_and_mul(self, x):
        up, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class PerTensorInt8(LayerOps):
    """One int8 scale for the whole batch (the abs-max of every row), given out per row."""

    def quantize_rows_int8(self, x, outlier_threshold):
        _, scale, outliers = super().quantize_rows_int8(x, outlier_threshold)
        batch_scale = scale.amax().expand_as(scale).contiguous()
        kept = x.float().index_fill(1, outliers, 0)
        return (kept / batch_scale).round().to(torch.int8), batch_scale, outliers


class OutliersInTheScale(LayerOps):
    """Leaves the outlier channels out of xq but not out of the row's abs-max, so the other
    channels are quantized on a scale an outlier sets."""

    def quantize_rows_int8(self, x, outlier_threshold):
        outliers = (x.abs().amax(dim=0) > outlier_threshold).nonzero().flatten()
        scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 127
        scaled = (x / scale).index_fill(1, outliers, 0)
        return scaled.round().to(torch.int8), scale, outliers


class TruncatingInt8(LayerOps):
    """Converts x / scale with ``.to(torch.int8)``, which rounds toward zero, not to nearest."""

    def quantize_rows_int8(self, x, outlier_threshold):
        _, scale, outliers = super().quantize_rows_int8(x, outlier_threshold)
        return (x.float() / scale).index_fill(1, outliers, 0).to(torch.int8), scale, outliers


class ExactGroupSums(LayerOps):
    """A group-affine matmul with int8 activations per 32 inputs that keeps each group's exact
    float sum for the offset term, rounding only the scale term: the rounding error then meets
    q · scale instead of the weight (what this project's own kernel did until issue 24)."""

    def pack_affine(self, weight):
        return _ExactSumsAffine(weight)


class _ExactSumsAffine(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        w = self.weight
        groups = x.float().view(x.shape[0], -1, w.group)  # [M, G, 32]
        step = (groups.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-30)
        rounded = ((groups / step).round() * step).view_as(x.float())
        scaled = rounded @ (w.q.float() * w.scale.repeat_interleave(w.group, 1)).t()
        return (scaled + groups.sum(-1) @ w.offset.t()).to(x.dtype)

    def rows(self, ids):
        return self.weight.rows(ids.flatten(), torch.float32).view(*ids.shape, -1)

    def dequantize(self):
        return self.weight.dequantize()


class NoneIsTheLastSlot(LayerOps):
    """Gathers each row's adapter by ``indices`` straight away, one batched matmul and no
    grouping: a row of no adapter (-1) indexes from the end and gets the last slot's delta."""

    def lora_shrink(self, x, a, scale, indices, ranks=None):
        return torch.einsum("tk,tnrk->tnr", x, a[indices]) * scale[indices].to(x.dtype)[..., None]

    def lora_expand(self, y, h, b, indices, output_sizes):
        start = 0
        for shard, size in enumerate(output_sizes):
            cols = b[indices, :, start : start + size]  # [T, R, size]
            y[:, start : start + size] += torch.einsum("tr,trn->tn", h[:, shard], cols)
            start += size
        return y


def _platform(name: str, ops_cls: type[LayerOps]) -> type[CpuPlatform]:
    """The CPU platform handing out ``ops_cls`` layer ops, ranked below every real one."""
    ops = ops_cls()
    return type(
        ops_cls.__name__ + "Platform",
        (CpuPlatform,),
        {"name": name, "priority": -100, "layer_ops": lambda self, dtype: ops},
    )


MUTANTS = {
    "stale-residual": StaleResidual,
    "eps-outside-the-root": EpsOutsideTheRoot,
    "norm-in-place": NormInPlace,
    "rotate-half-twice": RotateHalfTwice,
    "unstrided-rotary": UnstridedRotary,
    "pairs-as-halves": PairsAsHalves,
    "shared-qk-norm": SharedQkNorm,
    "swapped-swiglu": SwappedSwiGLU,
    "per-tensor-int8": PerTensorInt8,
    "outliers-in-the-scale": OutliersInTheScale,
    "truncating-int8": TruncatingInt8,
    "exact-group-sums": ExactGroupSums,
    "none-is-the-last-slot": NoneIsTheLastSlot,
}


@hookimpl
def register_platforms(register):
    for name, ops_cls in MUTANTS.items():
        register(name, _platform(name, ops_cls), api=2)
