"""The built-in platforms: cpu (always available) and cuda."""

import logging
import math
import mmap
import os
import sys
import time

import torch

from engine import openmp
from engine.builtin import heap
from engine.interfaces import Platform, StepGraphs

logger = logging.getLogger(__name__)

ZEROED_MAP_BYTES = 1 << 20  # smaller KV caches come from the allocator


def memory_available() -> tuple[int, int]:
    """(available, total) bytes of this machine's memory. Available is the kernel's MemAvailable
    (free pages and the page cache it can drop at once, psutil's ``available``, what vLLM reads),
    not free pages alone: after a few GB of files were read, free pages fell to ~1.3 of 24 GiB
    on an idle machine, and the KV cache with them. Free pages where /proc/meminfo is missing."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024, total
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * page, total


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 0
    preferred_attention_backends = ("torch",)

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        return []

    def free_memory(self) -> int:
        """What is available once the heap's free pages are given back (:mod:`engine.builtin.heap`
        keeps what the process frees)."""
        heap.give_back()
        return memory_available()[0]

    def memory_in_use(self) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * page
        return resident, os.sysconf("SC_PHYS_PAGES") * page

    def allocate_zeroed(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Anonymous pages from the kernel: zero by definition, resident only once written (writing
        gigabytes of zeros took seconds of every start). Not advised as huge pages: a fresh
        process writes each block first in a step, and in a virtual machine a 2 MiB page the
        guest had not used took ~7x longer a byte to appear than 4 KiB ones, more than the
        fewer TLB misses gave back: whole offline runs 1.06-1.10x faster on the system's
        default pages (docs/decisions.md, "The KV pool back on 4 KiB pages")."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < ZEROED_MAP_BYTES:
            return torch.zeros(shape, dtype=dtype)
        pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps `pages`

    def place_weights(self, storages: list[torch.UntypedStorage]) -> str | None:
        """The weights onto 2 MiB pages (:func:`engine.builtin.pages.onto_huge_pages`) where Linux
        has transparent huge pages. A decode step streams every weight once, and on 4 KiB pages
        the prefetchers stop at every page and each page costs a TLB entry: two instances of the
        default model in one process, one of them collapsed, decoded a single stream 1.02-1.05x
        faster on the huge pages (docs/decisions.md, "Weights on 2 MiB pages"). The pages the
        weights share with other allocations become resident whole (said in the log)."""
        if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
            return None
        from engine.builtin import pages

        resident, start = self.memory_in_use()[0], time.perf_counter()
        collapsed, advised = pages.onto_huge_pages(storages)
        if not advised:
            return None
        grown = max(0, self.memory_in_use()[0] - resident)
        weights = sum(s.nbytes() for s in storages)
        return (
            f"{collapsed / 2**20:.0f} MiB on 2 MiB pages now, {advised / 2**20:.0f} MiB advised, "
            f"holding {weights / 2**20:.0f} MiB of weights (+{grown / 2**20:.0f} MiB resident, "
            f"{time.perf_counter() - start:.2f} s)"
        )

    def release_memory(self, storages: list[torch.UntypedStorage]) -> int:
        if not sys.platform.startswith("linux"):
            return super().release_memory(storages)
        from engine.builtin import pages  # ctypes and /proc: only when sleeping

        released = pages.release(storages)
        heap.give_back()
        return released

    def configure(self) -> None:
        threads = int(os.environ.get("ENGINE_NUM_THREADS", len(os.sched_getaffinity(0))))
        torch.set_num_threads(threads)
        logger.info(
            "CPU threads: %d; OpenMP's idle threads wait: %s; heap: %s",
            threads,
            openmp.wait_policy(),
            heap.keep_freed_blocks(),
        )

    def configure_rank(self, rank: int, world_size: int) -> None:
        """Each rank computes on its share of the cores (ranks share one machine)."""
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))


class CudaGraphs(StepGraphs):
    """Decode steps captured as CUDA graphs, all in one memory pool (the largest first, so the
    smaller fit it)."""

    name = "CUDA graphs"
    overhead_bytes = 2 << 20  # per graph, beside the pool: its kernel nodes and the driver's bookkeeping

    def __init__(self):
        self._pool = None

    def record(self, forward):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = forward()
        torch.cuda.synchronize()
        return graph, hidden


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    priority = 10
    preferred_attention_backends = ("flashinfer", "flash-attn", "triton", "torch")

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        if not torch.cuda.is_available():
            return ["torch reports no CUDA device (CPU build of torch or no GPU)"]
        return []

    def free_memory(self) -> int:
        return torch.cuda.mem_get_info()[0]

    def memory_in_use(self) -> tuple[int, int]:
        return torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[1]

    def configure_rank(self, rank: int, world_size: int) -> None:
        torch.cuda.set_device(rank % torch.cuda.device_count())

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def step_graphs(self) -> StepGraphs:
        return CudaGraphs()
