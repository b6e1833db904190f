"""The ``cpu-native`` platform: the built-in CPU platform plus fused C layer ops.

It ranks above ``cpu`` (priority 1), so installing this plugin is enough to use it; it
reports itself unavailable — and ``cpu`` is chosen — when its kernels cannot be built.
"""

from __future__ import annotations

import functools

import torch

from engine.builtin.platforms import CpuPlatform
from engine.native import BuildError, tape
from engine_platforms_cpu_native import kernels
from engine_platforms_cpu_native.ops import NativeLayerOps


class NativeCpuPlatform(CpuPlatform):
    name = "cpu-native"
    priority = 1
    preferred_attention_backends = ("cpu-native", "mla-cpu-native", "torch")

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        try:
            kernels.library()
        except (BuildError, OSError) as error:
            return [f"cannot build its C kernels: {error}"]
        return []

    def step_graphs(self):
        """Native tapes, where this machine's calling convention allows them
        (:mod:`engine.native.tape`): every kernel of a decode step with the cpu-native attention
        and GGUF's packed weights is a C call, replayed from C without Python between layers."""
        return None if tape.unavailable_reasons() else tape.TapeGraphs()

    def layer_ops(self, dtype: torch.dtype):
        if dtype not in (torch.bfloat16, torch.float32):
            return super().layer_ops(dtype)
        return _native_ops(dtype)


@functools.cache
def _native_ops(dtype: torch.dtype) -> NativeLayerOps:
    """One instance per dtype: quant methods ask for the ops once per linear layer."""
    return NativeLayerOps(kernels.library(), dtype)
