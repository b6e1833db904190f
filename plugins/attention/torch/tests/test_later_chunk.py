"""The two ways attention-torch attends a later prefill chunk agree — the CPU's split (prefix
and chunk as unmasked flash calls merged by log-sum-exp) and one call with a mask shared by
all heads — and the whole contract holds with every later chunk split."""

import pytest
import torch
import torch.nn.functional as F

from engine.testing.attention import AttentionBackendContract
from engine_attention_torch.backend import TorchAttentionBackend, chunk_mask, later_chunk_split


class TestEveryLaterChunkSplit(AttentionBackendContract):
    backend_name = "torch"

    @pytest.fixture
    def backend_cls(self):
        class SplitAlways(TorchAttentionBackend):
            split_rows = 1

        return SplitAlways


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prefix_len, query_len", [(1, 5), (37, 64), (700, 300)])
def test_split_matches_shared_mask(dtype, tol, prefix_len, query_len):
    gen = torch.Generator().manual_seed(prefix_len)
    queries = torch.randn(1, 8, query_len, 32, generator=gen).to(dtype)
    keys, values = (torch.randn(1, 2, prefix_len + query_len, 32, generator=gen).to(dtype) for _ in range(2))
    split = later_chunk_split(queries, keys, values, prefix_len, 32**-0.5)
    masked = F.scaled_dot_product_attention(
        queries,
        keys,
        values,
        attn_mask=chunk_mask(prefix_len, query_len, "cpu"),
        scale=32**-0.5,
        enable_gqa=True,
    )
    assert split.dtype == dtype and split.shape == queries.shape
    torch.testing.assert_close(split.float(), masked.float(), atol=tol, rtol=tol)
