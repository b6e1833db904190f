"""The built-in platforms: cpu (always available) and cuda."""

import os

import torch

from engine.interfaces import Platform


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
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def memory_in_use(self) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * page
        return resident, os.sysconf("SC_PHYS_PAGES") * page

    def configure(self) -> None:
        threads = int(os.environ.get("ENGINE_NUM_THREADS", len(os.sched_getaffinity(0))))
        torch.set_num_threads(threads)

    def configure_rank(self, rank: int, world_size: int) -> None:
        """Each rank computes on its share of the cores (ranks share one machine)."""
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))


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
