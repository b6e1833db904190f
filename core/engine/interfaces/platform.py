"""Platform: the device the engine runs on. ``cpu`` and ``cuda`` are built in; a hardware
vendor ships another through ``register_platforms`` without forking the core."""

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


class Platform(ABC):
    name: ClassVar[str]
    device_type: ClassVar[str]  # torch device type: "cpu", "cuda", "xpu" ...
    dist_backend: ClassVar[str]  # torch.distributed backend for tensor parallelism
    priority: ClassVar[int] = 0  # among available platforms the highest wins
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    preferred_attention_backends: ClassVar[tuple[str, ...]] = ()

    @classmethod
    @abstractmethod
    def unavailable_reasons(cls) -> list[str]:
        """Why this platform cannot run in this process; empty when it can."""

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    @abstractmethod
    def free_memory(self) -> int:
        """Bytes available for weights and KV cache now."""

    def memory_in_use(self) -> tuple[int, int]:
        """(bytes this process holds on the device now, the device's total bytes), for
        ``memory_utilization``; a platform that cannot tell raises NotImplementedError."""
        raise NotImplementedError(f"platform {self.name} cannot report its memory in use")

    def configure(self) -> None:
        """Process-wide set-up (threads, allocator) before the model is built."""

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on synchronous devices)."""

    def layer_ops(self, dtype: torch.dtype):
        """The :class:`engine.layers.LayerOps` models and quant kernels use for the small ops
        between matmuls (RMSNorm with the residual add, rotary embedding, SwiGLU, W8A8's
        activation quantization and rescale) in ``dtype``. The default is plain torch; a
        platform with fused kernels returns a subclass overriding those it does better,
        checked by ``engine.testing.layer_ops``. Called once per layer at load: cache it."""
        from engine.layers.ops import LayerOps

        return LayerOps()
