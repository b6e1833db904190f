"""attention-flash-attn: the core's attention contract on a CUDA device (each path that can
run there; skipped without one), and on every machine the reasons and path choice it reports
and the per-step gather of the torch path against a plain computation."""

import importlib.util

import attrs
import pytest
import torch

from engine.builtin.platforms import CpuPlatform, CudaPlatform
from engine.interfaces import AttentionSpec
from engine.testing.attention import BATCHES, AttentionBackendContract, paged_layout
from engine_attention_flash_attn.backend import BUNDLED, PACKAGE, FlashAttnBackend, key_slots, path_reasons

CUDA = torch.cuda.is_available()
SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16)


@pytest.mark.skipif(not CUDA, reason="FlashAttention needs a CUDA device")
class TestFlashAttnOnCuda(AttentionBackendContract):
    """The bundled-kernel path at the engine's block sizes (the package path when installed
    takes blocks of 256: ``TestPackagePath``)."""

    backend_name = "flash-attn"
    platform_cls = CudaPlatform
    dtypes = (torch.bfloat16, torch.float16)
    block_sizes = (16, 32)
    dtype_tolerances = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.mark.skipif(
    not CUDA or importlib.util.find_spec("flash_attn") is None,
    reason="needs a CUDA device and the flash_attn package",
)
class TestPackagePath(TestFlashAttnOnCuda):
    block_sizes = (256,)


def test_refuses_the_cpu_platform():
    reasons = FlashAttnBackend.supports(SPEC, CpuPlatform())
    assert reasons == ["FlashAttention runs on the cuda platform only (this is cpu)"]
    assert FlashAttnBackend.describe(SPEC, CpuPlatform()) is None


@pytest.mark.skipif(CUDA, reason="checks the reasons given without a CUDA device")
def test_refuses_cuda_without_a_device():
    assert FlashAttnBackend.supports(SPEC, CudaPlatform()) == ["torch reports no CUDA device"]


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("dtype", torch.float32, "dtype torch.float32"),
        ("head_dim", 100, "head size 100"),
        ("num_kv_heads", 3, "not a multiple"),
    ],
)
def test_spec_reasons_name_what_it_refuses(field, value, reason):
    reasons = FlashAttnBackend.supports(attrs.evolve(SPEC, **{field: value}), CpuPlatform())
    assert any(reason in r for r in reasons)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed here")
def test_path_choice_without_the_package():
    reasons = path_reasons(SPEC)
    assert reasons[PACKAGE] == [
        "the flash_attn package is not installed",
        "its paged kernels need a block size that is a multiple of 256 (this is 16)",
    ]
    assert reasons[BUNDLED] == [] and FlashAttnBackend.path(SPEC) == BUNDLED
    softcapped = attrs.evolve(SPEC, logit_softcap=30.0)
    assert FlashAttnBackend.path(softcapped) is None
    assert path_reasons(softcapped)[BUNDLED] == ["it has no logit soft-cap"]


def test_key_slots_follow_block_tables_from_the_window_start():
    """The torch path's gather: request b's keys from ``first_keys[b]`` to its end, in the
    cache slots its (scattered, partly shared) blocks give."""
    requests = BATCHES["mixed"]
    tables = [[7, 3], [12, 5], [3, 9], [1, 2], [30, 4, 8, 6]]
    layout = paged_layout([(ctx, n) for ctx, n in requests], tables, 16)
    firsts = [0, 4, 0, 10, 20]
    expected = [
        tables[b][p // 16] * 16 + p % 16
        for b, (ctx, n) in enumerate(requests)
        for p in range(firsts[b], ctx + n)
    ]
    assert key_slots(layout, 16, firsts).tolist() == expected
