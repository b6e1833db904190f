"""Shared layers against plain math."""

import pytest
import torch

from engine.layers import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rms_norm_both_forms_match_plain_math(dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    x, residual = (torch.randn(tokens, 96, generator=gen).to(dtype) for _ in range(2))
    norm = RMSNorm(96, 1e-5, dtype)
    norm.weight.data = torch.rand(96, generator=gen).to(dtype) + 0.5
    h = x.float() + residual.float()
    want = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-5) * norm.weight.float()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    plain, summed = norm(x, residual)  # before loading ends: rms_norm
    norm.process_weights_after_loading()
    mirrored, _ = norm(x, residual)  # after: the layer norm of [h, -h]
    for got in (plain, mirrored):
        torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(summed, x + residual)
