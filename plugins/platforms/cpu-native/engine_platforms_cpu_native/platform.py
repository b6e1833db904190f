"""The ``cpu-native`` platform: the built-in CPU platform plus fused C layer ops.

It ranks above ``cpu`` (priority 1), so installing this plugin is enough to use it; it
reports itself unavailable — and ``cpu`` is chosen — when its kernels cannot be built.
"""

from __future__ import annotations

import functools

import torch

from engine.builtin.platforms import CpuPlatform
from engine.native import BuildError, tape
from engine_platforms_cpu_native import affine, kernels
from engine_platforms_cpu_native.ops import NativeLayerOps

# decode batches over 16 that a tape replays on AMX tiles, each padded up to the next size: the
# tiles multiply blocks of 32 rows, so a few padding rows cost about nothing, and replayed a
# step of 40 or 64 requests ran ~10 % faster than eagerly (benchmarks/RESULTS.md)
TILE_TAPE_SIZES = (24, 32, 48, 64)


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
        and GGUF's packed weights is a C call, replayed from C without Python between layers.
        On AMX tiles, which take a few more rows at about the same cost, steps of up to 64
        requests are replayed too, padded to :data:`TILE_TAPE_SIZES`."""
        if tape.unavailable_reasons():
            return None
        return tape.TapeGraphs(TILE_TAPE_SIZES if affine.amx_tiles() else ())

    def layer_ops(self, dtype: torch.dtype):
        if dtype not in (torch.bfloat16, torch.float32):
            return super().layer_ops(dtype)
        return _native_ops(dtype)


@functools.cache
def _native_ops(dtype: torch.dtype) -> NativeLayerOps:
    """One instance per dtype: quant methods ask for the ops once per linear layer."""
    return NativeLayerOps(kernels.library(), dtype)
