"""The CPU platform's KV pool: fresh zero pages, advised as huge pages so that attention's reads
from all over the pool are not a TLB miss a block."""

import mmap
import sys

import pytest
import torch

from engine.builtin.platforms import CpuPlatform

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"), reason="Linux's madvise"
)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError("no mapping holds the pool")


def test_the_pool_is_zero_and_advised_as_huge_pages():
    pool = CpuPlatform().allocate_zeroed((4, 1 << 20), torch.bfloat16)
    assert "hg" in _vm_flags(pool.data_ptr())
    assert not pool.any()
    pool[3, -1] = 1.0  # writable to its last byte
    assert pool.sum().item() == 1.0
