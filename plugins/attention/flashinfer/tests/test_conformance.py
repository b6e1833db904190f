"""attention-flashinfer: the core's attention contract on a CUDA device with FlashInfer
(skipped without them), and on every machine the reasons it reports and the layout → page
arguments conversion against a plain computation."""

import importlib.util

import attrs
import pytest
import torch

from engine.builtin.platforms import CpuPlatform, CudaPlatform
from engine.interfaces import AttentionSpec
from engine.testing.attention import BATCHES, AttentionBackendContract, paged_layout
from engine_attention_flashinfer.backend import FlashInferBackend, page_arguments

RUNNABLE = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16)


@pytest.mark.skipif(not RUNNABLE, reason="FlashInfer needs a CUDA device and the flashinfer package")
class TestFlashInferOnCuda(AttentionBackendContract):
    backend_name = "flashinfer"
    platform_cls = CudaPlatform
    dtypes = (torch.bfloat16, torch.float16)
    block_sizes = (16, 32)
    dtype_tolerances = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


def test_reasons_on_the_cpu_platform():
    reasons = FlashInferBackend.supports(SPEC, CpuPlatform())
    assert reasons[0] == "FlashInfer runs on the cuda platform only (this is cpu)"
    if importlib.util.find_spec("flashinfer") is None:
        assert "the flashinfer package is not installed" in reasons


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("dtype", torch.float32, "dtype torch.float32"),
        ("head_dim", 32, "head size 32 (one of 64, 128, 256)"),
        ("num_kv_heads", 3, "not a multiple"),
    ],
)
def test_spec_reasons_name_what_it_refuses(field, value, reason):
    assert any(
        reason in r for r in FlashInferBackend.supports(attrs.evolve(SPEC, **{field: value}), CpuPlatform())
    )


@pytest.mark.parametrize("block_size", [8, 16])
def test_page_arguments_match_a_plain_computation(block_size):
    """Scattered and shared pages, lengths that are not page multiples, an exact multiple."""
    requests = BATCHES["mixed"] + [(31, 1)]
    tables = [[7, 3, 11, 2, 13], [12, 5, 21], [3, 9], [1, 2, 4], [30, 4, 8, 6, 14, 15, 16], [40, 41, 42, 43]]
    layout = paged_layout(requests, tables, block_size)
    args = page_arguments(layout, block_size)
    qo, kv, indices, last = [0], [0], [], []
    for (ctx, n), table in zip(requests, tables):
        pages = (ctx + n + block_size - 1) // block_size
        qo.append(qo[-1] + n)
        kv.append(kv[-1] + pages)
        indices += table[:pages]
        last.append(ctx + n - (pages - 1) * block_size)
    assert args.qo_indptr.tolist() == qo and args.kv_indptr.tolist() == kv
    assert args.kv_indices.tolist() == indices and args.last_page_len.tolist() == last
    assert all(t.dtype == torch.int32 for t in attrs.astuple(args, recurse=False))
