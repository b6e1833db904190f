"""FP8 e4m3 weights: loaded from checkpoints (per-tensor or per-channel ``weight_scale``;
128×128 blocks as ``weight_scale_inv`` with ``weight_block_size``), or quantized online
per output channel from a float checkpoint (``--quantization fp8``).

Every scale layout becomes one float32 scale per (output row, input block) — exact, and it
lets q/k/v shards with different per-tensor scales or partial blocks fuse into one weight.

Paths: CUDA with compute capability ≥ 8.9 keeps the FP8 weight and runs ``torch._scaled_mm``
with per-token activation scales (row-wise weight scales; block-scaled weights use the
dequantized path there too). Everywhere else the weight is dequantized once at load to the
activation dtype: ``torch._scaled_mm`` exists on the CPU but measured ~20× slower than a
bf16 matmul, and dequantizing per step ~18× slower.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.interfaces import QuantMethod
from engine.layers import Layer

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def scaled_mm_unavailable(platform) -> list[str]:
    if platform.device_type != "cuda":
        return [f"{platform.name} has no FP8 matmul units torch uses"]
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return [f"compute capability {major}.{minor} < 8.9"]
    return []


class Fp8LinearMethod(QuantMethod):
    name = "fp8"

    def __init__(self, ctx):
        super().__init__(ctx)
        config = ctx.quant_config or {}
        self.block = config.get("weight_block_size")
        if self.block is not None and (len(self.block) != 2 or min(self.block) <= 0):
            raise ValueError(f"quantization: weight_block_size must be two positive sizes, got {self.block}")
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization: FP8 format {fmt!r} is not supported (only e4m3)")
        self.scale_name = "weight_scale_inv" if self.block else "weight_scale"
        self.fast = not scaled_mm_unavailable(ctx.platform) and self.block is None

    @classmethod
    def supports(cls, platform) -> list[str]:
        return [] if hasattr(torch, "float8_e4m3fn") else ["this torch has no float8_e4m3fn"]

    @classmethod
    def describe(cls, platform) -> str:
        reasons = scaled_mm_unavailable(platform)
        if not reasons:
            return "torch._scaled_mm on FP8 weights (row-wise scales; block scales dequantize at load)"
        return f"dequantized at load to the activation dtype ({'; '.join(reasons)})"

    def create_weights(self, layer, input_size, output_sizes):
        shards: list[dict] = [dict() for _ in output_sizes]
        online = self.ctx.quant_config is None
        names = ["weight"] if online else ["weight", self.scale_name]
        for name in names:
            param = nn.Parameter(torch.empty(0), requires_grad=False)
            param.weight_loader = lambda p, tensor, shard, name=name: shards[shard].__setitem__(name, tensor)
            layer.register_parameter(name, param)
        layer.fp8_shards = shards

    def process_weights_after_loading(self, layer):
        parts = [self._quantized(shard) for shard in layer.fp8_shards]
        for name in ("weight", self.scale_name):
            if hasattr(layer, name):
                delattr(layer, name)
        del layer.fp8_shards
        q = torch.cat([p[0] for p in parts])
        scale = torch.cat([p[1] for p in parts])
        group = q.shape[1] // scale.shape[1]
        if self.fast:
            layer.fp8 = Fp8Weight(q, scale)
        else:
            layer.dense = _dequantize(q, scale, group).to(self.ctx.dtype)

    def _quantized(self, shard: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (FP8 weight [n, K], float32 scale [n, K // group])."""
        weight = shard["weight"]
        if self.ctx.quant_config is None:  # online, per output channel
            scale = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
            return (weight.float() / scale).to(FP8), scale
        if weight.dtype != FP8:
            raise ValueError(
                f"quantization: fp8 checkpoint holds a {weight.dtype} weight, expected float8_e4m3fn"
            )
        scale = shard[self.scale_name].float()
        rows, cols = weight.shape
        if self.block:
            block_rows, block_cols = self.block
            if cols % block_cols:
                raise ValueError(
                    f"quantization: input size {cols} is not a multiple of the block {block_cols}"
                )
            return weight, scale.repeat_interleave(block_rows, dim=0)[:rows]
        return weight, scale.reshape(-1, 1).expand(rows, 1).contiguous()  # per-tensor or per-channel

    def apply(self, layer, x, bias):
        out = layer.fp8(x) if self.fast else F.linear(x, layer.dense)
        return out if bias is None else out + bias

    def dequantize(self, layer):
        if self.fast:
            return (layer.fp8.q_t.t().float() * layer.fp8.scale_row.t()).to(self.ctx.dtype)
        return layer.dense


def _dequantize(q, scale, group):
    rows, cols = q.shape
    return (q.float().view(rows, cols // group, group) * scale[..., None]).view(rows, cols)


class Fp8Weight(Layer):
    """FP8 weight with row-wise scales for ``torch._scaled_mm`` (CUDA, capability ≥ 8.9)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("q_t", q.t())  # column-major second operand, as _scaled_mm wants
        self.register_buffer("scale_row", scale.reshape(1, -1).float())

    def forward(self, x):
        x_scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        xq = (x.float() / x_scale).to(FP8)
        return torch._scaled_mm(xq, self.q_t, scale_a=x_scale, scale_b=self.scale_row, out_dtype=x.dtype)
