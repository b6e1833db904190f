"""Platform layer-ops contract: the :class:`engine.layers.LayerOps` a platform returns
against the plain-torch ones on random inputs — RMSNorm with and without the residual
add (also of rows near eps and a zero row), rotary embedding of fused q|k|v rows (also over
part of each head, in halves or interleaved pairs), the per-head q/k RMSNorm + rotary of
Qwen3, SwiGLU, W8A8's int8 activation quantization (rounded to nearest, with and without an
outlier channel) and int32 rescale — for batch 1, small batches
and a prefill-sized batch, in float32 and bfloat16, within the dtype's rounding; LoRA's
shrink and expand over a batch of mixed adapter slots (and rows of none); and packed
group-affine weights (``pack_affine``): exact rows, and a matmul within the bound that rounding
activations to int8 per 32 inputs allows, and ggml's blocks packed straight from their bytes
(``pack_affine_blocks``) as ``pack_affine`` packs the weight they hold; FP4 weights with float
block scales (``pack_fp4``, NVFP4's blocks of 16 and MXFP4's 32): the exact weight, and a
matmul of the activations as they are, within float32 summation order; Mamba2's causal conv and
selective scan over state slots (a fresh prefill chunk, a later one, decode rows) against a
float64 recurrence. Where the ops declare ``row_invariant`` (``--batch-invariant`` then runs
them), each op's rows in calls of 1 to 300 rows bit for bit those rows alone; where a packed
weight declares ``invariant_rows``, the same of its ``forward``, ``logits`` and ``greedy`` up to
that many rows. A platform without overrides passes trivially (the scan's reference is
checked all the same).

Inputs come as models hand them over, not only as fresh contiguous rows: views of a fused
projection whose rows are padded (a wider matmul output), and 3-D head views [T, H, D]
(contiguous, padded rows, or heads that are not adjacent in memory), so a kernel that
assumes a 2-D contiguous tensor fails here rather than in a model."""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F

from engine.interfaces import BatchLayout
from engine.layers import LayerOps, RMSNorm, RotaryEmbedding
from engine.layers.fp4 import Fp4Weight
from engine.layers.group_affine import AffineWeight
from engine.layers.ssm import SSMParams
from engine.plugins import load_plugins

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
TOKENS = [1, 5, 800]  # 800: a prefill chunk, enough values that a kernel may split its rows over threads
# call sizes whose rows are checked against each row alone: a decode batch's, past a 16-row tile,
# and enough rows that a kernel splits them over threads
ROW_INVARIANT_ROWS = [1, 2, 3, 7, 16, 17, 64, 300]
HEAD_LAYOUTS = ["contiguous", "padded-rows", "scattered-heads"]  # see _head_view
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
# LoRA's delta rounds twice in the activation dtype (the rank-R intermediate, then the sum)
LORA_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=6e-2)}


class LayerOpsContract:
    platform_name: str

    @pytest.fixture(scope="class")
    @classmethod
    def platform(cls):
        platform_cls = load_plugins().get("platforms", cls.platform_name)
        reasons = platform_cls.unavailable_reasons()
        if reasons:
            pytest.skip(f"{cls.platform_name} is unavailable here: {'; '.join(reasons)}")
        return platform_cls()

    @staticmethod
    def _norm(hidden, dtype, ops):
        norm = RMSNorm(hidden, 1e-6, dtype, ops)
        norm.weight.data = torch.rand(hidden, generator=torch.Generator().manual_seed(1)).to(dtype) + 0.5
        norm.process_weights_after_loading()
        return norm

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("tokens", TOKENS)
    @pytest.mark.parametrize("with_residual", [True, False])
    @pytest.mark.parametrize("hidden", [96, 100])  # 100: not a multiple of a 16-float vector
    def test_rms_norm(self, platform, dtype, tokens, with_residual, hidden):
        ops, gen = platform.layer_ops(dtype), torch.Generator().manual_seed(tokens)
        x, residual = (torch.randn(tokens, hidden, generator=gen).to(dtype) for _ in range(2))
        args = (x, residual) if with_residual else (x,)
        expected = self._norm(hidden, dtype, LayerOps())(*(a.clone() for a in args))
        got = self._norm(hidden, dtype, ops)(*(a.clone() for a in args))
        if with_residual:
            torch.testing.assert_close(got[1], expected[1], **TOLERANCE[dtype])
            got, expected = got[0], expected[0]
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("with_residual", [True, False])
    def test_rms_norm_of_small_and_zero_rows(self, platform, dtype, with_residual):
        """Rows whose mean square is near eps (1e-6) or under it, where an eps added outside the
        root or left out shows (the random rows above are far larger than eps), and an all-zero
        row, as a padded batch holds: normalized to zeros, not NaN."""
        gen = torch.Generator().manual_seed(0)
        magnitudes = torch.tensor([1.0, 1e-3, 1e-4, 1e-5, 0.0])[:, None]
        x, residual = (torch.randn(5, 100, generator=gen).mul(magnitudes).to(dtype) for _ in range(2))
        args = (x, residual) if with_residual else (x,)
        expected = self._norm(100, dtype, LayerOps())(*(a.clone() for a in args))
        got = self._norm(100, dtype, platform.layer_ops(dtype))(*(a.clone() for a in args))
        for g, e in zip(got, expected) if with_residual else [(got, expected)]:
            torch.testing.assert_close(g, e, **TOLERANCE[dtype])

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("tokens", TOKENS)
    def test_gather_rows(self, platform, dtype, tokens):
        """The rotary tables' lookup: exact rows, repeats allowed, an id out of range refused."""
        gen = torch.Generator().manual_seed(tokens)
        table = torch.randn(513, 1, 80, generator=gen).to(dtype)
        ids = torch.randint(0, 513, (tokens,), generator=gen)
        ops = platform.layer_ops(dtype)
        assert torch.equal(ops.gather_rows(table, ids), table[ids])
        for bad in (513, -1):
            with pytest.raises(IndexError):
                ops.gather_rows(table, torch.tensor([0, bad]))

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("tokens", TOKENS)
    @pytest.mark.parametrize("layout", HEAD_LAYOUTS)
    def test_rms_norm_of_head_views(self, platform, dtype, tokens, layout):
        """A per-head norm over [T, H, D] views (no residual: x is left as it is)."""
        x = _head_view(tokens, 6, 48, layout, torch.Generator().manual_seed(tokens), dtype)
        before = x.clone()
        expected = self._norm(48, dtype, LayerOps())(x.clone())
        got = self._norm(48, dtype, platform.layer_ops(dtype))(x)
        assert got.shape == x.shape
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
        assert torch.equal(x, before), "rms_norm without a residual must leave x as it is"

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("tokens", TOKENS)
    def test_rms_norm_with_residual_of_padded_rows(self, platform, dtype, tokens):
        gen = torch.Generator().manual_seed(tokens)
        x = _padded_rows(tokens, 96, 32, gen, dtype)
        residual = torch.randn(tokens, 96, generator=gen).to(dtype)
        expected = self._norm(96, dtype, LayerOps())(x.clone(), residual.clone())
        got = self._norm(96, dtype, platform.layer_ops(dtype))(_padded_copy(x), residual.clone())
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, **TOLERANCE[dtype])

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("tokens", TOKENS)
    @pytest.mark.parametrize("row_padding", [0, 64])
    @pytest.mark.parametrize("head_dim", [64, 48])  # 48: halves not a multiple of a 16-float vector
    def test_rotary_qkv(self, platform, dtype, tokens, row_padding, head_dim):
        heads, kv_heads = 4, 2
        gen = torch.Generator().manual_seed(tokens)
        cos_sin = _cos_sin(head_dim, tokens, gen, dtype)
        rows = _padded_rows(tokens, (heads + 2 * kv_heads) * head_dim, row_padding, gen, dtype)
        expected = LayerOps().rotary_qkv(rows.clone(), heads, kv_heads, head_dim, cos_sin)
        got = platform.layer_ops(dtype).rotary_qkv(_padded_copy(rows), heads, kv_heads, head_dim, cos_sin)
        _assert_qkv_close(got, expected, dtype)

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("tokens", TOKENS)
    @pytest.mark.parametrize("row_padding", [0, 64])
    @pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
    def test_partial_rotary_qkv(self, platform, dtype, tokens, row_padding, interleaved):
        """Tables half a head wide (``partial_rotary_factor`` 0.5): the rest of each head passes."""
        heads, kv_heads, head_dim = 4, 2, 64
        gen = torch.Generator().manual_seed(tokens)
        cos_sin = _cos_sin(head_dim // 2, tokens, gen, dtype)
        rows = _padded_rows(tokens, (heads + 2 * kv_heads) * head_dim, row_padding, gen, dtype)
        args = (heads, kv_heads, head_dim, cos_sin, interleaved)
        expected = LayerOps().partial_rotary_qkv(rows.clone(), *args)
        got = platform.layer_ops(dtype).partial_rotary_qkv(_padded_copy(rows), *args)
        _assert_qkv_close(got, expected, dtype)

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("tokens", TOKENS)
    @pytest.mark.parametrize("row_padding", [0, 64])
    @pytest.mark.parametrize("head_dim", [64, 48])  # 48: not a multiple of a 16-float vector
    def test_qk_norm_rotary(self, platform, dtype, tokens, row_padding, head_dim):
        heads, kv_heads = 4, 2
        gen = torch.Generator().manual_seed(tokens)
        cos_sin = _cos_sin(head_dim, tokens, gen, dtype)
        q_norm, k_norm = (self._norm(head_dim, dtype, LayerOps()) for _ in range(2))
        k_norm.weight.data = k_norm.weight.data.flip(0)  # q and k get different weights
        k_norm.process_weights_after_loading()
        rows = _padded_rows(tokens, (heads + 2 * kv_heads) * head_dim, row_padding, gen, dtype)
        expected = LayerOps().qk_norm_rotary(rows.clone(), q_norm, k_norm, heads, kv_heads, head_dim, cos_sin)
        ops = platform.layer_ops(dtype)
        q_norm.ops = k_norm.ops = ops
        got = ops.qk_norm_rotary(_padded_copy(rows), q_norm, k_norm, heads, kv_heads, head_dim, cos_sin)
        _assert_qkv_close(got, expected, dtype)

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("tokens", TOKENS)
    @pytest.mark.parametrize("row_padding", [0, 64])
    def test_silu_and_mul(self, platform, dtype, tokens, row_padding):
        x = _padded_rows(tokens, 2 * 80, row_padding, torch.Generator().manual_seed(tokens), dtype)
        expected = LayerOps().silu_and_mul(x.clone())
        got = platform.layer_ops(dtype).silu_and_mul(_padded_copy(x))
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("tokens", TOKENS)
    @pytest.mark.parametrize("outlier", [False, True])
    @pytest.mark.parametrize("cols", [100, 700])  # not a multiple of a vector; big enough to split
    @pytest.mark.parametrize("row_padding", [0, 36])
    def test_quantize_rows_int8(self, platform, dtype, tokens, outlier, cols, row_padding):
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, cols, generator=gen)
        if outlier:
            x[:, 7] *= 40
        x = x.to(dtype)
        padded = torch.randn(tokens, cols + row_padding, generator=gen).to(dtype)[:, :cols]
        padded.copy_(x)
        xq, scale, outliers = platform.layer_ops(dtype).quantize_rows_int8(padded, 6.0)
        ref_q, ref_scale, ref_outliers = LayerOps().quantize_rows_int8(x.clone(), 6.0)
        assert xq.dtype == torch.int8 and xq.shape == x.shape and scale.shape == (tokens, 1)
        assert outliers.tolist() == ref_outliers.tolist() and (7 in outliers.tolist()) == outlier
        torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
        assert (xq.int() - ref_q.int()).abs().max() <= 1  # a tie may round the other way
        assert not xq[:, outliers].any(), "outlier channels are zero in xq"
        kept = torch.ones(cols, dtype=torch.bool).index_fill_(0, outliers, False)
        rounding = (xq[:, kept].double() - x[:, kept].double() / scale.double()).abs().max().item()
        assert rounding <= 0.5 + 1e-3, f"x / scale rounded {rounding} away: not to nearest"

    @pytest.mark.parametrize("out_dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("tokens", TOKENS)
    @pytest.mark.parametrize("width", [100, 700])
    def test_rescale_int32(self, platform, out_dtype, tokens, width):
        gen = torch.Generator().manual_seed(tokens)
        acc = torch.randint(-(10**6), 10**6, (tokens, width), generator=gen, dtype=torch.int32)
        rows, cols = torch.rand(tokens, 1, generator=gen), torch.rand(1, width, generator=gen)
        got = platform.layer_ops(torch.bfloat16).rescale_int32(acc, rows, cols, out_dtype)
        expected = LayerOps().rescale_int32(acc, rows, cols, out_dtype)
        torch.testing.assert_close(got, expected, **TOLERANCE[out_dtype])

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("tokens", TOKENS)
    @pytest.mark.parametrize("bits", [4, 5, 8])
    @pytest.mark.parametrize("float16_scales", [False, True])  # as GGUF's legacy formats store them
    @pytest.mark.parametrize("symmetric", [False, True])  # offset −2^(bits−1)·scale: Q4_0, Q8_0, int8 rows
    def test_pack_affine(self, platform, dtype, tokens, bits, float16_scales, symmetric):
        gen = torch.Generator().manual_seed(tokens + bits)
        weight = _affine_weight(70, 96, bits, 32, gen, float16_scales)  # 70 outputs: no tile multiple
        if symmetric:
            weight = attrs.evolve(weight, offset=weight.scale * -(2 ** (bits - 1)))
        packed = platform.layer_ops(dtype).pack_affine(weight)
        if packed is None:
            return
        ids = torch.tensor([[0, 69], [15, 16]])
        assert torch.equal(packed.rows(ids), weight.rows(ids.flatten(), dtype).view(2, 2, -1))
        with pytest.raises(IndexError):
            packed.rows(torch.tensor([3, 70]))
        assert torch.equal(packed.dequantize(), weight.dequantize(dtype))
        x = torch.randn(tokens, 96, generator=gen).to(dtype)
        got, w = packed(x), weight.dequantize()
        assert got.dtype == dtype and got.shape == (tokens, 70)
        exact = x.float() @ w.t()
        torch.testing.assert_close(
            got.float(),
            exact,
            rtol=TOLERANCE[dtype]["rtol"],
            atol=_int8_activation_bound(x.float(), w).max().item() + TOLERANCE[dtype]["atol"],
        )

    @pytest.mark.parametrize("bits", [4, 8])
    def test_pack_affine_rounding_meets_the_weight(self, platform, bits):
        """Rounded activations times the weight, not times ``w − offset``: a kernel that keeps
        the group's exact float sum for the offset term (and rounds only the scale term) makes
        the rounding error meet q · scale, all of one sign, instead of the centred weight —
        within the worst-case bound above, but 1.9 times the error's RMS on weights centred as a
        model's are, and 5 times the KL divergence on the default model. Checked statistically:
        the error's RMS against that of round-to-nearest meeting w (variance step² / 12)."""
        gen = torch.Generator().manual_seed(bits)
        weight = _affine_weight(70, 256, bits, 32, gen, float16_scales=True)
        spread = 0.8 + 0.4 * torch.rand(weight.scale.shape, generator=gen)
        centred = weight.scale * -(2 ** (bits - 1)) * spread
        weight = attrs.evolve(weight, offset=centred.half().float())
        packed = platform.layer_ops(torch.float32).pack_affine(weight)
        if packed is None:
            return
        x, w = torch.randn(16, 256, generator=gen), weight.dequantize()
        error = packed(x).double() - (x.double() @ w.double().t())
        step = x.view(16, -1, 32).abs().amax(-1).double() / 127  # [rows, groups]
        mass = w.double().pow(2).view(70, -1, 32).sum(-1)  # [N, groups]
        expected = ((step.pow(2) / 12) @ mass.t()).mean().sqrt()
        assert error.pow(2).mean().sqrt() <= 1.25 * expected, "the rounding error does not meet w itself"

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("tokens", TOKENS)
    def test_pack_dense(self, platform, dtype, tokens):
        """A prepacked plain weight is the weight exactly and computes what ``F.linear`` does
        within float32 summation order, rounded once (or is declined); 70 outputs, 97 inputs
        (no multiple of a vector), with and without a bias, of 2-d and 3-d activations."""
        gen = torch.Generator().manual_seed(tokens)
        weight = (torch.randn(70, 97, generator=gen) * 0.1).to(dtype)
        packed = platform.layer_ops(dtype).pack_dense(weight.clone())
        if packed is None:
            pytest.skip(f"{self.platform_name} keeps F.linear for {dtype} weights")
        x, bias = torch.randn(tokens, 97, generator=gen).to(dtype), torch.randn(70, generator=gen).to(dtype)
        assert torch.equal(packed.dequantize(), weight)
        exact = x.double() @ weight.double().t()
        for got, want in [(packed(x), exact), (packed(x, bias), exact + bias.double())]:
            assert got.dtype == dtype and got.shape == (tokens, 70)
            torch.testing.assert_close(got.float(), want.to(dtype).float(), **TOLERANCE[dtype])
        assert torch.equal(packed(x.view(1, tokens, 97)), packed(x).view(1, tokens, 70))

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("layout", ["ggml:q4_0", "ggml:q4_1", "ggml:q8_0"])
    def test_pack_affine_blocks(self, platform, dtype, layout):
        """Blocks packed straight from the file's bytes are the weight they hold: exact rows
        and dequantization, and the matmul of ``pack_affine`` on that weight bit for bit (or
        None: the platform unpacks no such layout)."""
        gen = torch.Generator().manual_seed(len(layout))
        raw, weight = _ggml_blocks(70, 96, layout, gen)
        ops = platform.layer_ops(dtype)
        packed = ops.pack_affine_blocks([raw[:30], raw[30:]], layout)  # a fused layer's two parts
        if packed is None:
            return
        ids = torch.tensor([0, 16, 69])
        assert torch.equal(packed.rows(ids), weight.rows(ids, dtype))
        assert torch.equal(packed.dequantize(), weight.dequantize(dtype))
        x = torch.randn(5, 96, generator=gen).to(dtype)
        unpacked = ops.pack_affine(weight)
        assert unpacked is not None, "pack_affine_blocks packs what pack_affine declines"
        assert torch.equal(packed(x), unpacked(x))

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("tokens", TOKENS)
    @pytest.mark.parametrize("block", [16, 32])  # NVFP4's, MXFP4's
    def test_pack_fp4(self, platform, dtype, tokens, block):
        """An FP4 weight's kernel: its weight exactly (``E2M1[code] · scale``), and x · wᵀ of the
        activations as they are, summed in float32 (70 outputs, 160 inputs: no tile multiple)."""
        gen = torch.Generator().manual_seed(tokens + block)
        packed_codes = torch.randint(0, 256, (70, 80), generator=gen, dtype=torch.uint8)
        weight = Fp4Weight(packed_codes, torch.rand(70, 160 // block, generator=gen) * 0.05, block)
        packed = platform.layer_ops(dtype).pack_fp4(weight)
        if packed is None:
            pytest.skip(f"{self.platform_name} has no FP4 kernel")
        assert torch.equal(packed.dequantize(), weight.dequantize(dtype))
        x = torch.randn(tokens, 160, generator=gen).to(dtype)
        got = packed(x)
        assert got.dtype == dtype and got.shape == (tokens, 70)
        exact = (x.double() @ weight.dequantize().double().t()).float()
        torch.testing.assert_close(got.float(), exact, **TOLERANCE[dtype])

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    def test_row_invariant_ops_give_each_row_its_bits_alone(self, platform, dtype):
        """Ops that declare ``row_invariant`` (``--batch-invariant`` then runs them): each row
        of a call, from one row to a batch big enough to split over threads, bit for bit that
        row's result in a call of its own (a platform without the declaration passes)."""
        ops = platform.layer_ops(dtype)
        if not ops.row_invariant:
            return
        gen = torch.Generator().manual_seed(3)
        heads, kv_heads, head_dim, rows = 4, 2, 64, ROW_INVARIANT_ROWS[-1]
        norm, q_norm = self._norm(96, dtype, ops), self._norm(head_dim, dtype, ops)
        x, residual = (torch.randn(rows, 96, generator=gen).to(dtype) for _ in range(2))
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
        cos, sin = _cos_sin(head_dim, rows, gen, dtype)
        table = torch.randn(513, 80, generator=gen).to(dtype)
        ids = torch.randint(0, 513, (rows,), generator=gen)
        shape = (heads, kv_heads, head_dim)
        ops_of_rows = {
            "rms_norm": lambda r: (norm(x[r].clone()),),
            "add_rms_norm": lambda r: norm(x[r].clone(), residual[r].clone()),
            "rotary_qkv": lambda r: ops.rotary_qkv(qkv[r].clone(), *shape, (cos[r], sin[r])),
            "qk_norm_rotary": lambda r: ops.qk_norm_rotary(
                qkv[r].clone(), q_norm, q_norm, *shape, (cos[r], sin[r])
            ),
            "silu_and_mul": lambda r: (ops.silu_and_mul(qkv[r].clone()),),
            "gather_rows": lambda r: (ops.gather_rows(table, ids[r]),),
        }
        for name, op in ops_of_rows.items():
            alone = [op(slice(i, i + 1)) for i in range(rows)]
            for count in ROW_INVARIANT_ROWS:
                together = op(slice(0, count))
                for i in range(count):
                    for got, want in zip(together, alone[i]):
                        assert torch.equal(got[i : i + 1], want), f"{name}: row {i} of {count}"

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("bits", [4, 8])
    def test_pack_affine_invariant_rows(self, platform, dtype, bits):
        """A packed weight that declares ``invariant_rows`` gives each row of a call of up to
        that many rows (None: any number) the bits ``forward`` and ``logits`` give it alone, and
        ``greedy`` that row's first maximum of its logits alone."""
        gen = torch.Generator().manual_seed(bits)
        packed = platform.layer_ops(dtype).pack_affine(_affine_weight(1000, 96, bits, 32, gen))
        if packed is None or not hasattr(packed, "invariant_rows"):
            return
        limit = packed.invariant_rows
        counts = [c for c in ROW_INVARIANT_ROWS if limit is None or c <= limit]
        x = torch.randn(counts[-1], 96, generator=gen).to(dtype)
        logits = getattr(packed, "logits", None)
        for kernel in [packed, logits] if callable(logits) else [packed]:
            alone = [kernel(x[i : i + 1]) for i in range(counts[-1])]
            for count in counts:
                together = kernel(x[:count])
                assert all(torch.equal(together[i : i + 1], alone[i]) for i in range(count)), (kernel, count)
            if kernel is not packed and callable(getattr(packed, "greedy", None)):
                for count in counts:
                    tokens = packed.greedy(x[:count])
                    want = torch.cat([a.argmax(-1) for a in alone[:count]])
                    assert tokens is None or torch.equal(tokens, want), f"greedy at {count} rows"

    def test_pack_dense_invariant_rows(self, platform):
        """A prepacked bfloat16 weight that declares ``invariant_rows``: each row of a call of up
        to that many rows bit for bit its result alone."""
        gen = torch.Generator().manual_seed(7)
        packed = platform.layer_ops(torch.bfloat16).pack_dense(torch.randn(70, 96, generator=gen).bfloat16())
        if packed is None or not hasattr(packed, "invariant_rows"):
            return
        limit = packed.invariant_rows
        counts = [c for c in ROW_INVARIANT_ROWS if limit is None or c <= limit]
        x = torch.randn(counts[-1], 96, generator=gen).bfloat16()
        alone = torch.cat([packed(x[i : i + 1]) for i in range(counts[-1])])
        for count in counts:
            assert torch.equal(packed(x[:count]), alone[:count]), count

    def test_pack_affine_declines_what_it_cannot_hold(self, platform):
        """Groups of 16 (GGUF's Q6_K) are outside what any 32-group kernel holds: None, or
        a kernel that computes them right."""
        weight = _affine_weight(32, 64, 6, 16, torch.Generator().manual_seed(0))
        packed = platform.layer_ops(torch.float32).pack_affine(weight)
        if packed is not None:
            assert torch.equal(packed.dequantize(), weight.dequantize())

    @pytest.mark.parametrize("rows", ["mixed", "one-slot"])
    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("tokens", TOKENS)
    @pytest.mark.parametrize("output_sizes", [(96,), (64, 32, 32)], ids=["one-shard", "qkv"])
    def test_lora_shrink_expand(self, platform, dtype, tokens, output_sizes, rows):
        """LoRA's two grouped ops on a mixed batch: rows of three slots and of none (-1)
        interleaved, the last slot in use (a -1 read as a Python index lands there), one slot
        idle, one adapter of a rank below the slots' (zero rows past it), a fused shard left
        out (scale 0), each slot's rank given; or every row of one slot (one adapter for the
        whole batch). y +
        scale·B·A·x per row against plain float64 math; x is left as it is and rows of none
        keep y exactly."""
        gen = torch.Generator().manual_seed(tokens + len(output_sizes))
        slots, rank, size, n = 4, 16, 80, len(output_sizes)
        a = torch.randn(slots, n, rank, size, generator=gen) * 0.2
        b = torch.randn(slots, rank, sum(output_sizes), generator=gen) * 0.2
        a[0, :, 8:], b[0, 8:] = 0, 0  # slot 0: an adapter of rank 8
        ranks = torch.full((slots, n), rank)
        ranks[0] = 8
        scale = torch.rand(slots, n, generator=gen) + 0.5
        scale[2, 0] = 0  # slot 2 leaves its first shard out
        a, b = a.to(dtype), b.to(dtype)
        pattern = (-1, 0, 3, 2, -1, 3) if rows == "mixed" else (2,)  # slot 1 idle
        indices = torch.tensor([pattern[i % len(pattern)] for i in range(tokens)])
        x, y = (
            torch.randn(tokens, size, generator=gen).to(dtype),
            torch.randn(tokens, sum(output_sizes), generator=gen).to(dtype),
        )
        ops, x_given = platform.layer_ops(dtype), x.clone()
        h = ops.lora_shrink(x, a, scale, indices, ranks)
        got = ops.lora_expand(y.clone(), h, b, indices, output_sizes)
        assert torch.equal(x, x_given), "lora_shrink wrote into x"
        none = indices < 0
        assert torch.equal(got[none], y[none]), "rows of no adapter changed"
        torch.testing.assert_close(
            got, _lora_reference(x, y, a, b, scale, indices, output_sizes).to(dtype), **LORA_TOLERANCE[dtype]
        )

    def test_mamba_conv_and_scan_over_state_slots(self, platform):
        """One step of four requests in slots 3, 1, 4, 2: a fresh 11-row prefill chunk (the
        scan's 4-row chunks cross), a 7-row chunk continuing from its slot, a decode row from
        its slot and a fresh one-row prompt (its slot holds a former owner's state, which must
        not leak). Outputs and the states left in the slots against a float64 recurrence."""
        gen = torch.Generator().manual_seed(7)
        heads, head_dim, groups, size, kernel = 4, 8, 2, 16, 4
        channels = heads * head_dim + 2 * groups * size
        query_lens, seq_lens, slots = (11, 7, 1, 1), (11, 20, 30, 1), (3, 1, 4, 2)
        rows = sum(query_lens)
        layout = BatchLayout(
            torch.tensor([0, 11, 18, 19, 20], dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(slots, dtype=torch.int32)[:, None],
            torch.zeros(rows, dtype=torch.int64),
            query_lens,
            seq_lens,
        )
        conv_states = torch.randn(5, channels, kernel - 1, generator=gen)
        ssm_states = torch.randn(5, heads, head_dim, size, generator=gen)
        x = torch.randn(rows, channels, generator=gen)
        weight, bias = torch.randn(channels, kernel, generator=gen), torch.randn(channels, generator=gen)
        dt, b_c = torch.randn(rows, heads, generator=gen), torch.randn(2, rows, groups, size, generator=gen)
        params = SSMParams(
            -torch.rand(heads, generator=gen) - 0.5,
            torch.randn(heads, generator=gen),
            torch.randn(heads, generator=gen),
            (0.0, float("inf")),
            4,
        )
        want_conv, want_conv_states = _conv_reference(x, weight, bias, conv_states, layout)
        want, want_states = _scan_reference(
            want_conv[:, : heads * head_dim], dt, b_c, params, ssm_states, layout
        )
        ops = platform.layer_ops(torch.float32)
        conv = ops.causal_conv1d(x, weight, bias, conv_states, layout)
        got = ops.ssm_scan(
            conv[:, : heads * head_dim].reshape(rows, heads, head_dim), dt, *b_c, params, ssm_states, layout
        )
        tol = dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(conv.double(), want_conv, **tol)
        torch.testing.assert_close(conv_states[list(slots)].double(), want_conv_states[list(slots)], **tol)
        torch.testing.assert_close(got.double().flatten(1), want, **tol)
        torch.testing.assert_close(ssm_states[list(slots)].double(), want_states[list(slots)], **tol)


def _spans(layout):
    start = 0
    for q, s, slot in zip(layout.query_lens, layout.seq_lens_host, layout.block_table[:, 0].tolist()):
        yield slice(start, start + q), slot, s == q
        start += q


def _conv_reference(x, weight, bias, states, layout):
    """silu(depthwise causal conv) row by row in float64, each request from its slot's inputs."""
    out, states = torch.empty(x.shape, dtype=torch.float64), states.double().clone()
    for rows, slot, fresh in _spans(layout):
        window = torch.zeros_like(states[slot]) if fresh else states[slot]
        for r in range(rows.start, rows.stop):
            window = torch.cat([window, x[r].double()[:, None]], dim=1)
            out[r] = F.silu((window * weight.double()).sum(1) + bias.double())
            window = window[:, 1:]
        states[slot] = window
    return out, states


def _scan_reference(x, dt, b_c, params, states, layout):
    """The selective scan as its recurrence, row by row in float64: y [T, H·P], the states."""
    heads = dt.shape[1]
    x, states = x.double().view(x.shape[0], heads, -1), states.double().clone()
    b, c = (t.double().repeat_interleave(heads // t.shape[1], dim=1) for t in b_c)
    step = F.softplus(dt.double() + params.dt_bias.double())
    out = torch.empty_like(x)
    for rows, slot, fresh in _spans(layout):
        state = torch.zeros_like(states[slot]) if fresh else states[slot]
        for r in range(rows.start, rows.stop):
            decay = torch.exp(step[r] * params.A.double())[:, None, None]
            state = state * decay + (step[r][:, None] * x[r])[..., None] * b[r][:, None, :]
            out[r] = (state @ c[r][:, :, None])[..., 0] + params.D.double()[:, None] * x[r]
        states[slot] = state
    return out.flatten(1), states


def _lora_reference(x, y, a, b, scale, indices, output_sizes) -> torch.Tensor:
    """y + scale[s, i] · B[s, :, shard i's outputs] · A[s, i] · x in float64, row by row's slot s."""
    slot = indices.clamp(min=0)
    h = torch.einsum("tk,tnrk->tnr", x.double(), a.double()[slot]) * scale.double()[slot][..., None]
    shard_of_row = torch.repeat_interleave(torch.arange(len(output_sizes)), torch.tensor(output_sizes))
    delta = (b.double()[slot] * h[:, shard_of_row].transpose(1, 2)).sum(1)
    return y.double() + delta * (indices >= 0).double()[:, None]


def _padded_rows(tokens: int, width: int, padding: int, gen, dtype) -> torch.Tensor:
    """[tokens, width] rows of a wider buffer (row stride width + padding), as a slice of a
    fused projection's output is."""
    return torch.randn(tokens, width + padding, generator=gen).to(dtype)[:, :width]


def _padded_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of x with x's strides (``clone`` would make padded rows contiguous)."""
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).copy_(x)


def _assert_qkv_close(got, expected, dtype) -> None:
    tolerance = TOLERANCE[dtype]
    for name, g, e in zip("qkv", got, expected):
        assert g.shape == e.shape, name

        def message(m: str, name: str = name) -> str:
            return f"{name}: {m}"

        torch.testing.assert_close(g, e, rtol=tolerance["rtol"], atol=tolerance["atol"], msg=message)


def _head_view(tokens: int, heads: int, head_dim: int, layout: str, gen, dtype) -> torch.Tensor:
    """[tokens, heads, head_dim] laid out as a model may hand it over: contiguous, the
    heads of a padded fused projection, or heads that are not adjacent in memory (a
    [heads, tokens, head_dim] buffer seen token-major)."""
    if layout == "contiguous":
        return torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    if layout == "padded-rows":
        return _padded_rows(tokens, heads * head_dim, 40, gen, dtype).view(tokens, heads, head_dim)
    return torch.randn(heads, tokens, head_dim, generator=gen).to(dtype).transpose(0, 1)


def _cos_sin(head_dim: int, tokens: int, gen, dtype):
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=512
    )
    return RotaryEmbedding(config, 512, dtype)(torch.randint(0, 512, (tokens,), generator=gen))


def _affine_weight(rows: int, cols: int, bits: int, group: int, gen, float16_scales=False) -> AffineWeight:
    q = torch.randint(0, 2**bits, (rows, cols), generator=gen, dtype=torch.uint8)
    scale = torch.rand(rows, cols // group, generator=gen) * 0.05
    offset = -torch.rand(rows, cols // group, generator=gen) * 2 ** (bits - 1) * 0.05
    if float16_scales:
        scale, offset = scale.half().float(), offset.half().float()
    return AffineWeight(q, scale, offset, group, bits)


def _ggml_blocks(rows: int, cols: int, layout: str, gen) -> tuple[torch.Tensor, AffineWeight]:
    """Random ggml blocks of ``layout`` (q4_0: float16 d + 16 bytes of nibbles, the low ones the
    first 16 values; q4_1: d, m + the same; q8_0: d + 32 int8) as uint8 [rows, bytes per row],
    and the weight they hold (w = q · d - 8d, q · d + m, (q - 128) · d)."""
    groups = cols // 32
    d = (torch.rand(rows, groups, 1, generator=gen) * 0.05).half()
    m = (-torch.rand(rows, groups, 1, generator=gen) * 0.4).half()
    if layout == "ggml:q8_0":
        q = torch.randint(-128, 128, (rows, groups, 32), generator=gen, dtype=torch.int8)
        parts, values, offset = [d.view(torch.uint8), q.view(torch.uint8)], q.int() + 128, -128 * d.float()
    else:
        values = torch.randint(0, 16, (rows, groups, 32), generator=gen, dtype=torch.int32)
        nibbles = (values[..., :16] | (values[..., 16:] << 4)).to(torch.uint8)
        head = [d.view(torch.uint8), m.view(torch.uint8)] if layout == "ggml:q4_1" else [d.view(torch.uint8)]
        parts, offset = [*head, nibbles], m.float() if layout == "ggml:q4_1" else -8 * d.float()
    raw = torch.cat(parts, dim=-1).reshape(rows, -1)
    bits = 8 if layout == "ggml:q8_0" else 4
    scale, offset = d.float().reshape(rows, groups), offset.reshape(rows, groups)
    return raw, AffineWeight(values.to(torch.uint8).reshape(rows, cols), scale, offset, 32, bits)


def _int8_activation_bound(x: torch.Tensor, w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """The largest error int8 activations (per row and per ``group`` inputs, abs-max / 127
    steps, round to nearest) can add to x · wᵀ: half a step times Σ|w| in each group."""
    half_step = x.view(x.shape[0], -1, group).abs().amax(-1) / 254  # [rows, groups]
    weight_mass = w.abs().view(w.shape[0], -1, group).sum(-1)  # [N, groups]
    return half_step @ weight_mass.t() * 1.01  # float32 rounding of the sums
