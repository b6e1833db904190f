"""The CPU platform's pages: the KV pool fresh zero pages on the system's default page size
(a fresh 2 MiB page costs more to appear than its fewer TLB misses give back); a loaded
model's weights moved onto 2 MiB pages in place."""

import logging
import mmap
import sys

import pytest
import torch

from engine.builtin import pages
from engine.builtin.platforms import CpuPlatform

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"), reason="Linux's madvise"
)


def _smaps(address: int) -> dict[str, list[str]]:
    """The /proc/self/smaps fields of the mapping of this process that holds ``address``."""
    fields: dict[str, list[str]] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head, *rest = line.split()
            if "-" in head and not head.endswith(":"):
                if fields is not None:
                    return fields
                lo, hi = (int(x, 16) for x in head.split("-"))
                fields = {} if lo <= address < hi else None
            elif fields is not None:
                fields[head.rstrip(":")] = rest
    if fields is None:
        raise AssertionError("no mapping holds the address")
    return fields


def _vm_flags(address: int) -> list[str]:
    return _smaps(address)["VmFlags"]


def test_the_pool_is_zero_and_not_advised_as_huge_pages():
    pool = CpuPlatform().allocate_zeroed((4, 1 << 20), torch.bfloat16)
    assert "hg" not in _vm_flags(pool.data_ptr())
    assert not pool.any()
    pool[3, -1] = 1.0  # writable to its last byte
    assert pool.sum().item() == 1.0


def test_weights_move_onto_huge_pages_with_their_addresses_and_bytes():
    weight = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8)  # a mapping of its own (malloc)
    before, address = weight.clone(), weight.data_ptr()
    collapsed, advised = pages.onto_huge_pages([weight.untyped_storage()])
    assert advised >= 10 << 20  # every 2 MiB page the bytes touch (those shared at the edges too)
    assert "hg" in _vm_flags(address + (4 << 20))
    assert weight.data_ptr() == address and torch.equal(weight, before)
    if collapsed == advised:  # Linux 6.1 or later with huge pages free: they hold the bytes now
        assert int(_smaps(address + (4 << 20))["AnonHugePages"][0]) >= 2 << 10  # kB


def test_a_file_mapping_is_left_as_it_is(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * (16 << 12))  # 4 MiB
    weight = torch.from_file(str(path), shared=True, size=4 << 20, dtype=torch.uint8)
    assert pages.onto_huge_pages([weight.untyped_storage()]) == (0, 0)
    assert "hg" not in _vm_flags(weight.data_ptr())


def test_a_loaded_model_says_where_its_weights_went(tiny_llama, caplog):
    from engine import LLM

    with caplog.at_level(logging.INFO, logger="engine.core.setup"):
        llm = LLM(tiny_llama[0], dtype="float32", num_blocks=64, block_size=16)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights: ")]
    assert len(lines) == 1 and "on 2 MiB pages now" in lines[0], lines
    embedding = llm.engine.model.model.embed_tokens.weight
    assert "hg" in _vm_flags(embedding.data_ptr())
