"""A Triton kernel for MXFP4 linear layers: decodes e2m1 codes and E8M0 scales inside the
matmul, so the weight stays at 4.25 bits in memory. It is the path on CUDA; on the CPU it
runs only under ``TRITON_INTERPRET=1`` (the tests check it against dequantize-then-matmul),
because the interpreter is far slower than the int4-plane kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N = 16, 32


@triton.jit
def _mxfp4_matmul_kernel(
    x_ptr,
    blocks_ptr,
    scales_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    lanes = tl.arange(0, 32)  # the 32 inputs of one MX block
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block in range(K // 32):
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + block * 32 + lanes[None, :], mask=rows[:, None] < M, other=0.0
        ).to(tl.float32)  # [BLOCK_M, 32]
        packed = tl.load(
            blocks_ptr + cols[None, :] * (K // 2) + block * 16 + (lanes // 2)[:, None],
            mask=cols[None, :] < N,
            other=0,
        )  # [32, BLOCK_N], two codes a byte
        code = (packed >> ((lanes % 2) * 4)[:, None]) & 15  # even element in the low nibble
        exponent = (code >> 1) & 3
        mantissa = (code & 1).to(tl.float32)
        magnitude = tl.where(
            exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * tl.exp2((exponent - 1).to(tl.float32))
        )
        value = tl.where((code >> 3) == 1, -magnitude, magnitude)
        scale = tl.load(scales_ptr + cols * (K // 32) + block, mask=cols < N, other=127)
        acc += tl.dot(x, value * tl.exp2(scale.to(tl.float32) - 127)[None, :])
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :],
        acc,
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] · Wᵀ for W given as ``weight_blocks`` [N, K/32, 16] and ``weight_scales``."""
    x = x.contiguous()
    (m, k), n = x.shape, blocks.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _mxfp4_matmul_kernel[grid](
        x,
        blocks.contiguous(),
        scales.contiguous(),
        out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
    )
    return out.to(x.dtype)
