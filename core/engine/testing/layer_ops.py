"""Platform layer-ops contract: the :class:`engine.layers.LayerOps` a platform returns
against the plain-torch ones on random inputs — RMSNorm with and without the residual
add, rotary embedding of fused q|k|v rows (padded row strides too), SwiGLU, W8A8's int8
activation quantization (with and without an outlier channel) and int32 rescale — for
batch 1, small batches and a prefill-sized batch, in float32 and bfloat16, within the
dtype's rounding. A platform without overrides passes trivially."""

from __future__ import annotations

import pytest
import torch

from engine.layers import LayerOps, RMSNorm, RotaryEmbedding
from engine.plugins import load_plugins

DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 5, 300]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


class LayerOpsContract:
    platform_name: str

    @pytest.fixture(scope="class")
    def platform(self):
        registry = load_plugins()
        cls = registry.get("platforms", self.platform_name)
        reasons = cls.unavailable_reasons()
        if reasons:
            pytest.skip(f"{self.platform_name} is unavailable here: {'; '.join(reasons)}")
        return cls()

    @staticmethod
    def _norm(hidden, dtype, ops):
        norm = RMSNorm(hidden, 1e-6, dtype, ops)
        norm.weight.data = torch.rand(hidden, generator=torch.Generator().manual_seed(1)).to(dtype) + 0.5
        norm.process_weights_after_loading()
        return norm

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("tokens", TOKENS)
    @pytest.mark.parametrize("with_residual", [True, False])
    def test_rms_norm(self, platform, dtype, tokens, with_residual):
        ops, gen = platform.layer_ops(dtype), torch.Generator().manual_seed(tokens)
        x, residual = (torch.randn(tokens, 96, generator=gen).to(dtype) for _ in range(2))
        args = (x, residual) if with_residual else (x,)
        expected = self._norm(96, dtype, LayerOps())(*(a.clone() for a in args))
        got = self._norm(96, dtype, ops)(*(a.clone() for a in args))
        if with_residual:
            torch.testing.assert_close(got[1], expected[1], **TOLERANCE[dtype])
            got, expected = got[0], expected[0]
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("tokens", TOKENS)
    @pytest.mark.parametrize("row_padding", [0, 64])
    def test_rotary_qkv(self, platform, dtype, tokens, row_padding):
        from transformers import LlamaConfig

        heads, kv_heads, head_dim = 4, 2, 64
        config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, max_position_embeddings=512)
        gen = torch.Generator().manual_seed(tokens)
        cos_sin = RotaryEmbedding(config, 512, dtype)(torch.randint(0, 512, (tokens,), generator=gen))
        width = (heads + 2 * kv_heads) * head_dim
        rows = torch.randn(tokens, width + row_padding, generator=gen).to(dtype)
        expected = LayerOps().rotary_qkv(rows[:, :width].clone(), heads, kv_heads, head_dim, cos_sin)
        ops = platform.layer_ops(dtype)
        got = ops.rotary_qkv(rows.clone()[:, :width], heads, kv_heads, head_dim, cos_sin)
        for name, g, e in zip("qkv", got, expected):
            assert g.shape == e.shape, name
            torch.testing.assert_close(g, e, **TOLERANCE[dtype], msg=lambda m, name=name: f"{name}: {m}")

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("tokens", TOKENS)
    def test_silu_and_mul(self, platform, dtype, tokens):
        x = torch.randn(tokens, 2 * 80, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        expected = LayerOps().silu_and_mul(x.clone())
        got = platform.layer_ops(dtype).silu_and_mul(x.clone())
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("tokens", TOKENS)
    @pytest.mark.parametrize("outlier", [False, True])
    def test_quantize_rows_int8(self, platform, dtype, tokens, outlier):
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, 96, generator=gen)
        if outlier:
            x[:, 7] *= 40
        x = x.to(dtype)
        xq, scale, outliers = platform.layer_ops(dtype).quantize_rows_int8(x.clone(), 6.0)
        ref_q, ref_scale, ref_outliers = LayerOps().quantize_rows_int8(x.clone(), 6.0)
        assert xq.dtype == torch.int8 and xq.shape == x.shape and scale.shape == (tokens, 1)
        assert outliers.tolist() == ref_outliers.tolist() and (7 in outliers.tolist()) == outlier
        torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
        assert (xq.int() - ref_q.int()).abs().max() <= 1  # a tie may round the other way

    @pytest.mark.parametrize("out_dtype", DTYPES)
    @pytest.mark.parametrize("tokens", TOKENS)
    def test_rescale_int32(self, platform, out_dtype, tokens):
        gen = torch.Generator().manual_seed(tokens)
        acc = torch.randint(-10 ** 6, 10 ** 6, (tokens, 80), generator=gen, dtype=torch.int32)
        rows, cols = torch.rand(tokens, 1, generator=gen), torch.rand(1, 80, generator=gen)
        got = platform.layer_ops(torch.bfloat16).rescale_int32(acc, rows, cols, out_dtype)
        expected = LayerOps().rescale_int32(acc, rows, cols, out_dtype)
        torch.testing.assert_close(got, expected, **TOLERANCE[out_dtype])
