"""platforms-cpu-native: its layer ops against the core's contract, the same greedy tokens
as the plain CPU platform on a tiny model, a clear refusal where it cannot build, and its
AVX-512 kernels against the plain-C build a CPU without AVX-512 gets."""

import json
import os
import subprocess
import sys

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers import LayerOps, RMSNorm
from engine.layers.fp4 import Fp4Weight
from engine.layers.group_affine import AffineWeight
from engine.native import BuildError, load_source
from engine.testing.layer_ops import LayerOpsContract
from engine.testing.reference import random_prompts, tiny_checkpoint
from engine_platforms_cpu_native import affine, dense, kernels
from engine_platforms_cpu_native.affine import PackedAffine
from engine_platforms_cpu_native.dense import TiledBf16, WidenedBf16
from engine_platforms_cpu_native.fp4 import PackedFp4
from engine_platforms_cpu_native.ops import NativeLayerOps
from engine_platforms_cpu_native.platform import _native_ops


class TestCpuNativeLayerOps(LayerOpsContract):
    platform_name = "cpu-native"


TINY = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
ARCHITECTURES = {
    "LlamaForCausalLM": dict(model_type="llama"),
    "Qwen3ForCausalLM": dict(model_type="qwen3", head_dim=64),
}  # the q/k-norm kernel


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    folders = {}
    for arch, kwargs in ARCHITECTURES.items():
        folders[arch] = str(tmp_path_factory.mktemp(arch))
        tiny_checkpoint(folders[arch], arch, dict(TINY, **kwargs))
    return folders


# Qwen3 in float32 only: in bfloat16 its q/k norm sums in another order than torch's layer
# norm (the contract's tolerance holds), and a random tiny model's near-ties then flip tokens.
@pytest.mark.parametrize(
    ("arch", "dtype"),
    [("LlamaForCausalLM", "float32"), ("LlamaForCausalLM", "bfloat16"), ("Qwen3ForCausalLM", "float32")],
)
def test_same_greedy_tokens_as_the_plain_cpu_platform(tiny_models, arch, dtype):
    tiny_model = tiny_models[arch]
    prompts = random_prompts(256, [5, 17, 30], seed=3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens = {}
    for device in ("cpu", "cpu-native"):
        llm = LLM(tiny_model, dtype=dtype, device=device, max_model_len=256)
        assert llm.engine.platform.name == device
        tokens[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["cpu-native"] == tokens["cpu"]


def test_chosen_over_cpu_when_installed():
    from engine.testing import select_platform

    assert select_platform().name == "cpu-native"


def test_missing_compiler_is_a_reason_and_cpu_is_chosen(tmp_path):
    with pytest.raises(BuildError, match="no C compiler"):
        load_source(kernels.SOURCE, "no-such-compiler")
    script = (
        "import json; from engine.testing import select_platform;"
        "from engine_platforms_cpu_native.platform import NativeCpuPlatform as P;"
        "print(json.dumps([P.unavailable_reasons(), select_platform().name]))"
    )
    env = dict(os.environ, CC="no-such-compiler", XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    reasons, chosen = json.loads(out.stdout.strip().splitlines()[-1])
    assert chosen == "cpu" and "no C compiler" in reasons[0]


@pytest.fixture(scope="module")
def portable_ops():
    """The layer ops on the plain-C build: what a CPU without AVX-512 runs."""
    return {
        dtype: NativeLayerOps(load_source(kernels.SOURCE, portable=True), dtype)
        for dtype in (torch.float32, torch.bfloat16)
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_w8a8_passes_agree_with_the_portable_build(portable_ops, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 700, generator=gen)
    x[:, 3] *= 40
    x = x.to(dtype)
    native = _native_ops(dtype).quantize_rows_int8(x, 6.0)
    portable = portable_ops[dtype].quantize_rows_int8(x, 6.0)
    assert torch.equal(native[0], portable[0]) and torch.equal(native[1], portable[1])
    assert native[2].tolist() == portable[2].tolist() == [3]
    acc = torch.randint(-(10**6), 10**6, (rows, 700), generator=gen, dtype=torch.int32)
    row_scale, col_scale = torch.rand(rows, 1, generator=gen), torch.rand(1, 700, generator=gen)
    assert torch.equal(
        _native_ops(dtype).rescale_int32(acc, row_scale, col_scale, dtype),
        portable_ops[dtype].rescale_int32(acc, row_scale, col_scale, dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 700])  # 700 rows split over threads
@pytest.mark.parametrize("head_dim", [64, 36])  # 36: halves of 18, no whole 8- or 16-lane vectors
def test_norm_and_rotary_agree_with_the_portable_build(portable_ops, dtype, rows, head_dim):
    """The 16-lane rows (tails masked) or 8-lane ones (AVX2: scalar tails) against the scalar
    loops: the norms differ only in the order of the sum of squares, the rotation not at all."""
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(100, 1e-6, dtype)
    norm.weight.data = (torch.rand(100, generator=gen) + 0.5).to(dtype)
    x, residual = (torch.randn(rows, 100, generator=gen).to(dtype) for _ in range(2))
    results = [
        ops[dtype].rms_norm(norm, x.clone(), residual.clone()) + (ops[dtype].rms_norm(norm, x),)
        for ops in ({dtype: _native_ops(dtype)}, portable_ops)
    ]
    for native, portable in zip(*results):
        torch.testing.assert_close(native, portable, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)
    qkv = torch.randn(rows, 8 * head_dim, generator=gen).to(dtype)
    angles = torch.rand(rows, 1, head_dim // 2, generator=gen) * 6
    cos_sin = (angles.cos().repeat(1, 1, 2).to(dtype), torch.cat([-angles.sin(), angles.sin()], -1).to(dtype))
    rotated = [
        torch.cat(ops.rotary_qkv(qkv.clone(), 4, 2, head_dim, cos_sin), dim=1)
        for ops in (_native_ops(dtype), portable_ops[dtype])
    ]
    assert torch.equal(*rotated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 90])  # 90 rows x 1000 split over threads
def test_swiglu_agrees_with_the_portable_build_and_torch(portable_ops, dtype, rows):
    """The vector exp against libm's expf and torch's; large gates (exp overflow) included."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * 1003, generator=gen) * 4
    x[:, :4] = torch.tensor([-200.0, -90.0, 90.0, 0.0])
    x = x.to(dtype)
    native, portable = _native_ops(dtype).silu_and_mul(x), portable_ops[dtype].silu_and_mul(x)
    reference = LayerOps().silu_and_mul(x)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(native, portable, **tolerance)
    torch.testing.assert_close(native, reference, **tolerance)
    assert torch.isfinite(native).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 6, 300])
@pytest.mark.parametrize("form", [affine.SZ_F32, affine.SZ_F16, affine.SZ_F16_CENTRED])
def test_packed_affine_agrees_with_the_portable_build(dtype, bits, rows, form, monkeypatch):
    """The same int32 group sums in both builds; only the float sums' order differs (the
    kernels' own: no AMX tiles)."""
    monkeypatch.setenv(kernels.TILES_VARIABLE, "0")
    gen = torch.Generator().manual_seed(rows)
    weight = _random_affine(bits, gen, form)
    n, k = weight.shape
    native, portable = PackedAffine(weight, dtype), PackedAffine(weight, dtype, portable=True)
    assert native.form == form
    assert torch.equal(native.qw, portable.qw) and torch.equal(native.sz, portable.sz)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(native(x), portable(x), **tolerance)
    ids = torch.tensor([0, 16, 74, 3])
    assert torch.equal(native.rows(ids), portable.rows(ids))
    assert torch.equal(native.dequantize(), portable.rows(torch.arange(n)))  # the whole weight, exact


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_centred_scales_give_the_two_row_forms_bits(portable, bits):
    """Q4_0 and Q8_0 keep their float16 scales alone (the file's bytes: 18 and 34 a block, not
    20 and 36); each kernel makes every offset from its scale, the very float the two-row form
    would store, so matmul, logits, rows and the whole weight come out bit for bit the same."""
    gen = torch.Generator().manual_seed(bits)
    weight = _random_affine(bits, gen, affine.SZ_F16_CENTRED, n=75, k=576)
    centred = PackedAffine(weight, torch.bfloat16, portable=portable)
    assert centred.form == affine.SZ_F16_CENTRED
    blocks = centred.qw.numel() * 8 // bits // 32  # 32-value blocks, the last pair's padding included
    packed_bytes = centred.qw.numel() + centred.sz.numel() * centred.sz.element_size()
    assert packed_bytes / blocks == (18 if bits == 4 else 34)
    two_rows = PackedAffine(weight, torch.bfloat16, portable=portable)
    two_rows.sz = torch.stack([centred.sz, centred.sz * -(2 ** (bits - 1))], dim=-2)  # scales, then offsets
    two_rows.form = affine.SZ_F16
    x = torch.randn(7, 576, generator=gen).bfloat16()
    ids = torch.tensor([0, 16, 74, 3])
    assert torch.equal(centred(x), two_rows(x))
    assert torch.equal(centred.logits(x), two_rows.logits(x))
    assert torch.equal(centred.rows(ids), two_rows.rows(ids))
    assert torch.equal(centred.dequantize(), two_rows.dequantize())
    exact = weight.dequantize(torch.float32)
    torch.testing.assert_close(centred.dequantize().float(), exact, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_logits_recompute_each_rows_largest_exactly(dtype, bits):
    """``logits``: float32; each row's ``LOGITS_REFINED`` largest of the int8 product are the
    activations times the exact weight, the rest the int8 product itself; both builds agree
    within the float sums' order, and a row is the same in any batch."""
    gen = torch.Generator().manual_seed(10 + bits)
    weight = _random_affine(bits, gen, n=300, k=576)
    native, portable = PackedAffine(weight, dtype), PackedAffine(weight, dtype, portable=True)
    x = (torch.randn(9, 576, generator=gen) * torch.linspace(0.1, 10, 576)).to(dtype)
    exact = (x.double() @ weight.dequantize(torch.float64).T).float()
    rounded = PackedAffine(weight, torch.float32)(x.float())  # the int8 product, float32 out
    logits = native.logits(x)
    assert logits.dtype == torch.float32
    top = rounded.topk(affine.LOGITS_REFINED, dim=-1).indices
    refined = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top, True)
    torch.testing.assert_close(logits[refined], exact[refined], rtol=1e-5, atol=1e-4)
    assert torch.equal(logits[~refined], rounded[~refined])
    error = (logits[refined] - exact[refined]).abs().max()
    assert (rounded[refined] - exact[refined]).abs().max() > 100 * error
    torch.testing.assert_close(logits, portable.logits(x), rtol=1e-5, atol=1e-4)
    assert torch.equal(logits, torch.cat([native.logits(x[i : i + 4]) for i in range(0, 9, 4)]))


@pytest.fixture(scope="module")
def avx2_affine():
    """``quant_gemm.c`` built for AVX2 with AVX-512 off (what a CPU without AVX512_VNNI runs),
    its entry points bound: on an AVX-512 machine the native build never runs that path."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2 on this CPU")
    library = load_source(affine.SOURCE, extra_flags=("-mno-avx512f",))
    if library["affine_simd_width"]() != 256:
        pytest.skip("the compiler gave no AVX2 build")
    return {symbol: library[symbol] for symbol in ("affine_matmul_f32", "affine_rows_f32")}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 6, 70])
@pytest.mark.parametrize("form", [affine.SZ_F32, affine.SZ_F16, affine.SZ_F16_CENTRED])
def test_the_avx2_build_agrees_with_the_portable_build(avx2_affine, bits, rows, form, monkeypatch):
    """The AVX2 kernel reads the packed layout as plain C does: a pair's tiles taken in turn by
    groups while streamed, whole from cache (1, 3, 6 and 70 rows), a lone last tile in a padded
    pair (75 outputs), every scale form; its float sums are the AVX-512 kernel's op for op, and
    its row lookups the plain C's, bit for bit."""
    monkeypatch.setenv(kernels.TILES_VARIABLE, "0")
    gen = torch.Generator().manual_seed(rows * 10 + bits)
    weight = _random_affine(bits, gen, form, n=75, k=576)
    portable = PackedAffine(weight, torch.float32, portable=True)
    n, k = weight.shape
    x = torch.randn(rows, k, generator=gen)
    out = torch.empty(rows, n)
    pointers = portable.qw.data_ptr(), portable.sz.data_ptr(), portable.form, portable.storage_bits
    avx2_affine["affine_matmul_f32"](x.data_ptr(), k, rows, k, *pointers, n, out.data_ptr())
    torch.testing.assert_close(out, portable(x), rtol=1e-4, atol=1e-4)  # the float sums' order
    if affine.kernels()["affine_simd_width"]() == 512:
        assert torch.equal(out, PackedAffine(weight, torch.float32)(x))
    ids = torch.tensor([0, 16, 74, 3])
    looked_up = torch.empty(len(ids), k)
    lookup = avx2_affine["affine_rows_f32"]
    assert lookup(*pointers, k, n, ids.data_ptr(), len(ids), looked_up.data_ptr()) == 0
    assert torch.equal(looked_up, portable.rows(ids, torch.float32))


@pytest.mark.parametrize("bits", [4, 8])
def test_extreme_groups_sum_exactly(bits):
    """The largest values times activations of ±127 (AVX2 sums a whole group in int16 lanes,
    at most 30480 of 32767): exactly the portable build's integers and the float product."""
    n, k = 40, 256
    q = torch.full((n, k), 2**bits - 1, dtype=torch.uint8)
    q[5], q[7, ::2] = 0, 0
    weight = AffineWeight(q, torch.ones(n, k // 32), torch.zeros(n, k // 32), 32, bits)
    x = torch.ones(3, k)
    x[1, ::3], x[2] = -1.0, -1.0
    native = PackedAffine(weight, torch.float32)(x)
    assert torch.equal(native, PackedAffine(weight, torch.float32, portable=True)(x))
    assert torch.equal(native, x @ q.float().T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_is_the_same_in_any_batch(dtype, bits, monkeypatch):
    """53 rows at once give bit for bit what 8 rows at a time give: the kernel's 4-row blocks
    compute each row alone, so a row's result does not depend on its batch (without the tiles
    an AMX CPU would run the 53 on)."""
    monkeypatch.setenv(kernels.TILES_VARIABLE, "0")
    gen = torch.Generator().manual_seed(bits)
    weight = _random_affine(bits, gen)
    k = weight.shape[1]
    packed = PackedAffine(weight, dtype)
    x = torch.randn(53, k, generator=gen).to(dtype)
    assert torch.equal(packed(x), torch.cat([packed(x[i : i + 8]) for i in range(0, 53, 8)]))


def _tile_product(weight: AffineWeight, x: torch.Tensor, out_dtype: torch.dtype, portable: bool = False):
    """``affine_matmul_amx`` of bf16 rows x: on AMX tiles where this build and CPU have them,
    else (and in the portable build) its plain C."""
    packed = PackedAffine(weight, torch.bfloat16, portable=portable)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype)
    affine.kernels(portable)["affine_matmul_amx"](
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], packed.qw.data_ptr(), packed.sz.data_ptr(),
        packed.form, packed.storage_bits, weight.shape[0], int(out_dtype == torch.float32), out.data_ptr(),
    )  # fmt: skip
    return out


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("rows", "k"), [(1, 576), (16, 576), (17, 576), (33, 576), (70, 576), (300, 4096)])
@pytest.mark.parametrize("form", [affine.SZ_F32, affine.SZ_F16, affine.SZ_F16_CENTRED])
def test_the_tile_product_is_x_times_the_bf16_weight(bits, rows, k, form):
    """``affine_matmul_amx``: bf16 rows times the weight rounded to bf16, summed in float32, in
    either build (AMX tiles with the weight dequantized on the fly, or plain C), within the
    float sums' order; bf16 out is that rounded. Rows past a 16-row tile, columns past a tile
    pair (75), every scale form, 4 and 8 bits, and a chunk long enough for the tiles to take
    it in two passes (300 rows of 4096 inputs)."""
    gen = torch.Generator().manual_seed(rows * 10 + bits)
    weight = _random_affine(bits, gen, form, n=75, k=k)
    x = torch.randn(rows + 3, k, generator=gen).to(torch.bfloat16)[3:]  # rows of a wider view
    exact = x.float() @ weight.dequantize(torch.bfloat16).float().T
    scale = exact.abs().max().item()
    for portable in (False, True):
        product = _tile_product(weight, x, torch.float32, portable)
        torch.testing.assert_close(product, exact, rtol=0, atol=1e-5 * scale)
        rounded = _tile_product(weight, x, torch.bfloat16, portable)
        torch.testing.assert_close(rounded, product.to(torch.bfloat16))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("form", [affine.SZ_F32, affine.SZ_F16, affine.SZ_F16_CENTRED])
def test_the_tiles_weight_is_the_dequantized_weight_bit_for_bit(bits, form):
    """Rows of the identity pick the tiles' bf16 weight out exactly (one product, the rest
    zeros): every value is ``dequantize``'s, bf16(q · scale + offset) rounded as it rounds, in
    either build and every scale form."""
    gen = torch.Generator().manual_seed(bits + 7 * form)
    weight = _random_affine(bits, gen, form, n=75, k=576)
    picked = torch.arange(0, 576, 7)
    x = torch.eye(576, dtype=torch.bfloat16)[picked]
    expected = weight.dequantize(torch.bfloat16).float().T[picked]
    for portable in (False, True):
        assert torch.equal(_tile_product(weight, x, torch.float32, portable), expected)


@pytest.mark.skipif(not affine.amx_tiles(), reason="this CPU has no AMX tiles")
@pytest.mark.parametrize("bits", [4, 8])
def test_steps_over_tile_rows_run_on_the_tiles_the_rest_on_the_kernel(bits, monkeypatch):
    """On AMX a bf16 step of more than ``TILE_ROWS`` rows is the tile product, and a row's bits
    do not depend on how many rows share its step there; up to ``TILE_ROWS`` rows — every
    decode step a native tape records — the int8 kernel's bits, as with the tiles off."""
    gen = torch.Generator().manual_seed(bits)
    weight = _random_affine(bits, gen)
    packed = PackedAffine(weight, torch.bfloat16)
    assert packed.on_tiles and not PackedAffine(weight, torch.float32).on_tiles
    x = torch.randn(53, weight.shape[1], generator=gen).to(torch.bfloat16)
    assert torch.equal(packed(x), _tile_product(weight, x, torch.bfloat16))
    assert torch.equal(packed(x[:40]), packed(x)[:40])
    monkeypatch.setenv(kernels.TILES_VARIABLE, "0")
    off = PackedAffine(weight, torch.bfloat16)
    assert not off.on_tiles
    rows = affine.TILE_ROWS
    assert torch.equal(packed(x[:rows]), off(x[:rows]))
    assert not torch.equal(packed(x), off(x))


@pytest.mark.skipif(not affine.amx_tiles(), reason="this CPU has no AMX tiles")
def test_logits_on_the_tiles_keep_each_rows_largest_exact():
    """A vocabulary table's logits over more than ``TILE_ROWS`` rows come from the tiles' float32
    product, each row's ``LOGITS_REFINED`` largest recomputed as the kernel's path does: the
    same values there, the rest within bf16's rounding of the weight."""
    gen = torch.Generator().manual_seed(3)
    weight = _random_affine(8, gen)
    packed = PackedAffine(weight, torch.bfloat16)
    x = torch.randn(affine.TILE_ROWS + 3, weight.shape[1], generator=gen).to(torch.bfloat16)
    exact = x.float() @ weight.dequantize(torch.float32).T
    on_tiles = packed.logits(x)
    by_kernel = torch.cat([packed.logits(x[i : i + 1]) for i in range(x.shape[0])])
    top = by_kernel.topk(affine.LOGITS_REFINED, dim=-1)
    assert torch.equal(on_tiles.gather(1, top.indices[:, :8]), top.values[:, :8])
    torch.testing.assert_close(on_tiles, exact, rtol=1e-2, atol=1e-2 * exact.abs().max().item())


def test_tiles_follow_the_cpu_and_the_switch(monkeypatch):
    """Batched steps go to tiles where the build and the process have AMX (``affine_amx``), for
    bf16 activations only, never with ``ENGINE_CPU_AMX_TILES=0``."""
    monkeypatch.delenv(kernels.TILES_VARIABLE, raising=False)
    weight = _random_affine(4, torch.Generator().manual_seed(0))
    has_amx = bool(affine.kernels()["affine_amx"]())
    assert affine.amx_tiles() == has_amx
    assert PackedAffine(weight, torch.bfloat16).on_tiles == has_amx
    assert not affine.kernels(portable=True)["affine_amx"]()
    monkeypatch.setenv(kernels.TILES_VARIABLE, "0")
    assert not affine.amx_tiles() and not PackedAffine(weight, torch.bfloat16).on_tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [16, 32])
def test_packed_fp4_agrees_with_the_portable_build(dtype, block):
    """The FP4 kernel's AVX2 build against its plain-C one and exact math, 75 outputs (not a
    multiple of its 4 columns), 1, 6 and 301 rows (odd: its 2-row blocks); and a row's result is
    the same in any batch (each row is summed alone)."""
    gen = torch.Generator().manual_seed(block)
    weight = Fp4Weight(
        torch.randint(0, 256, (75, 80), generator=gen, dtype=torch.uint8),
        torch.rand(75, 160 // block, generator=gen) * 0.05,
        block,
    )
    native, portable = PackedFp4(weight, dtype), PackedFp4(weight, dtype, portable=True)
    assert torch.equal(native.dequantize(), portable.dequantize())
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-3)
    for rows in (1, 6, 301):
        x = torch.randn(rows, 160, generator=gen).to(dtype)
        torch.testing.assert_close(native(x), portable(x), **tolerance)
        exact = (x.double() @ weight.dequantize().double().t()).to(dtype)
        torch.testing.assert_close(native(x), exact, **tolerance)
    assert torch.equal(native(x), torch.cat([native(x[i : i + 7]) for i in range(0, 301, 7)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(75, 163), (4, 8), (1, 5), (301, 576)])
def test_widened_bf16_agrees_with_the_portable_build_and_exact_math(dtype, n, k):
    """The bfloat16 widening kernel's AVX2 build against its plain-C one and float64 math: odd
    outputs (not a multiple of its 4 columns), inputs short of and not a multiple of a vector,
    1, 6 and 37 rows (odd: its 2-row blocks), with and without a bias; the weight exactly; and
    a row's result is the same in any batch, alone included (each row is summed alone, in the
    same order at every row count, however the calls prefetch: batch-invariant)."""
    gen = torch.Generator().manual_seed(n * k)
    weight = (torch.randn(n, k, generator=gen) * 0.1).to(torch.bfloat16)
    native, portable = WidenedBf16(weight, dtype), WidenedBf16(weight, dtype, portable=True)
    assert torch.equal(native.dequantize(), weight) and torch.equal(portable.dequantize(), weight)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-3)
    bias = torch.randn(n, generator=gen).to(dtype)
    for rows in (1, 6, 37):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        exact = x.double() @ weight.double().t()
        torch.testing.assert_close(native(x), portable(x), **tolerance)
        torch.testing.assert_close(native(x), exact.to(dtype), **tolerance)
        torch.testing.assert_close(native(x, bias), (exact + bias.double()).to(dtype), **tolerance)
    for rows in (1, 5):
        assert torch.equal(native(x), torch.cat([native(x[i : i + rows]) for i in range(0, 37, rows)]))
    wide = torch.randn(3, k + 9, generator=gen).to(dtype)[:, :k]  # rows apart in memory
    assert torch.equal(native(wide), native(wide.contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_widened_bf16_gives_a_row_the_same_bits_in_any_batch_on_either_path_and_the_portable_build(
    dtype, portable
):
    """Batch invariance across the kernel's two AVX2 paths: each of 300 rows alone (the 2-row
    blocks) against the first and last 3, 17 (the same blocks), 64, 67 and 300 rows of one batch
    (register tiles from ``dense_tiled_min_rows()``: 67 leaves a 3-row tile), bit for bit, and
    against float32 math. 101 outputs leave a 2-column tile and a short panel; 1103 inputs span
    three passes and end short of a vector. The portable build (one path) is held to the same:
    what its ``invariant_rows`` (None, any number) declares to ``--batch-invariant``."""
    gen = torch.Generator().manual_seed(24)
    n, k = 101, 1103
    weight = (torch.randn(n, k, generator=gen) * 0.1).to(torch.bfloat16)
    layer = WidenedBf16(weight, dtype, portable=portable)
    assert layer.invariant_rows is None
    tiled_from = dense.kernels(portable)["dense_tiled_min_rows"]()
    if portable or not dense.kernels()["dense_simd_width"]():
        assert tiled_from == 0
    else:
        assert 17 < tiled_from <= 64
    x = torch.randn(300, k, generator=gen).to(dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(300)])
    for rows in (3, 17, 64, 67, 300):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
        assert torch.equal(layer(x[-rows:]), alone[-rows:]), rows
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(alone, (x.float() @ weight.float().t()).to(dtype), **tolerance)


def test_widened_bf16_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="not a 2-d bfloat16 one"):
        WidenedBf16(torch.zeros(4, 8), torch.float32)
    with pytest.raises(ValueError, match=r"activations in torch.float16"):
        WidenedBf16(torch.zeros(4, 8, dtype=torch.bfloat16), torch.float16)


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize(("n", "k"), [(75, 163), (33, 64), (960, 576), (16, 1)])
def test_tiled_bf16_is_x_times_w_summed_in_float_and_the_same_in_any_batch(n, k, portable):
    """``dense_matmul_amx`` (AMX tiles, or the plain C of the portable build) against float64
    math, with and without a bias: outputs past a 16-row tile and a 32-row panel (75, 33), inputs
    not a multiple of the tiles' 32 (163, 1: the zero-padded copy), 1 to 300 rows (past a tile,
    a block pair and a 256-row pass); a row's bits are the same alone, in any batch and as a
    strided view (what its ``invariant_rows``, None, declares)."""
    if not portable and not dense.amx_tiles():
        pytest.skip("this CPU has no AMX tiles")
    gen = torch.Generator().manual_seed(n * k)
    weight = (torch.randn(n, k, generator=gen) * 0.1).to(torch.bfloat16)
    layer = TiledBf16(weight, portable=portable)
    assert torch.equal(layer.dequantize(), weight) and layer.invariant_rows is None
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(300, k, generator=gen).to(torch.bfloat16)
    exact = x.double() @ weight.double().t()
    tolerance = dict(rtol=8e-3, atol=1e-3 * max(1.0, exact.abs().max().item()))
    torch.testing.assert_close(layer(x), exact.to(torch.bfloat16), **tolerance)
    torch.testing.assert_close(layer(x, bias), (exact + bias.double()).to(torch.bfloat16), **tolerance)
    alone = torch.cat([layer(x[i : i + 1], bias) for i in range(300)])
    for rows in (3, 16, 17, 33, 64, 300):
        assert torch.equal(layer(x[-rows:], bias), alone[-rows:]), rows
    wide = torch.randn(37, k + 9, generator=gen).to(torch.bfloat16)[:, :k]  # rows apart in memory
    assert torch.equal(layer(wide), layer(wide.contiguous()))


def test_pack_dense_takes_amx_tiles_else_onednn_else_widens_bf16():
    """On AMX (and unless ``ENGINE_CPU_AMX_TILES=0``) bfloat16 weights go to the tiles; else
    oneDNN's packed bfloat16 where the CPU computes bfloat16, exactly as the plain ops give it;
    the widening kernel where it does not and AVX2 + FMA are there; float32 weights stay
    F.linear's."""
    from engine.layers.dense import PackedDense, packable

    weight = torch.randn(16, 32).to(torch.bfloat16)
    held = _native_ops(torch.bfloat16).pack_dense(weight)
    if dense.amx_tiles():
        assert isinstance(held, TiledBf16)
    elif packable(weight):
        assert isinstance(held, PackedDense)
    elif dense.kernels()["dense_simd_width"]():
        assert isinstance(held, WidenedBf16)
    else:
        assert held is None
    assert _native_ops(torch.float32).pack_dense(torch.randn(16, 32)) is None


def test_the_switch_keeps_bf16_weights_off_the_tiles(monkeypatch):
    monkeypatch.setenv(kernels.TILES_VARIABLE, "0")
    assert not dense.amx_tiles()
    weight = torch.randn(16, 32).to(torch.bfloat16)
    assert not isinstance(_native_ops(torch.bfloat16).pack_dense(weight), TiledBf16)
    assert not dense.kernels(portable=True)["dense_amx"]()


def _random_affine(bits: int, gen, form: int = affine.SZ_F32, n: int = 75, k: int = 160) -> AffineWeight:
    """n × k random ``bits``-bit values in 32-input groups (75 outputs: no tile multiple), with
    scales and offsets that pack into ``form``: float32, float16, or float16 scales with every
    offset -2^(bits-1) · scale (GGUF's Q4_0 and Q8_0)."""
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    scale, offset = torch.rand(n, k // 32, generator=gen) * 0.05, -torch.rand(n, k // 32, generator=gen) * 0.3
    if form != affine.SZ_F32:
        scale, offset = scale.half().float(), offset.half().float()
    if form == affine.SZ_F16_CENTRED:
        offset = scale * -(2 ** (bits - 1))
    return AffineWeight(q, scale, offset, 32, bits)


def test_the_start_up_notes_name_the_weights_on_amx_tiles(monkeypatch):
    """``notes`` tells the start-up report which weights multiply on AMX tiles, and nothing
    where none do."""
    monkeypatch.delenv(kernels.TILES_VARIABLE, raising=False)
    ops = _native_ops(torch.bfloat16)
    held = ops.pack_dense(torch.randn(16, 32).to(torch.bfloat16))
    model = torch.nn.ModuleList([held or torch.nn.Identity()])
    expected = ["AMX: bfloat16 weights multiply on AMX tiles"] if dense.amx_tiles() else []
    assert ops.notes(model) == expected
    assert ops.notes(torch.nn.ModuleList([torch.nn.Identity()])) == []
