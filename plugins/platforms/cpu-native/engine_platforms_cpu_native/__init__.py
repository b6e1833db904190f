"""tessellm-platforms-cpu-native: the CPU platform with fused C kernels for the small ops
between a layer's matmuls (residual add + RMSNorm, rotary embedding)."""

from engine import hookimpl


@hookimpl
def register_platforms(register):
    register("cpu-native", "engine_platforms_cpu_native.platform:NativeCpuPlatform", api=3)
