"""Reading a checkpoint's ``quantization_config`` for AWQ and GPTQ: every setting the packing
depends on is checked here, at start-up, and a bad one refused in one line naming it."""

from __future__ import annotations

import attrs

AWQ_VERSIONS = ("gemm",)  # GEMV, GEMV-fast, Marlin and ExLlama AWQ pack their bits differently
GPTQ_BITS = (4, 8)
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 2}  # checkpoint_format -> how its zero points are stored


@attrs.frozen
class PackedIntConfig:
    """What a packed-integer checkpoint's tensors mean: ``bits`` per value, ``group`` inputs
    per scale (None: the whole input, GPTQ's ``group_size: -1``), and ``zero_bias``, added to
    each stored zero point (GPTQ v1 stores ``z − 1``)."""

    method: str
    bits: int
    group: int | None
    zero_bias: int = 0

    def group_for(self, input_size: int, where: str = "") -> int:
        """The group size of a layer of ``input_size`` inputs; refuses one that does not divide it
        (``where`` says whose inputs they are, e.g. a tensor-parallel rank's)."""
        group = self.group or input_size
        if input_size % group:
            raise ValueError(
                f"quantization: {self.method} group_size {group} does not divide a layer's "
                f"input size {input_size}{where}"
            )
        return group


def _required_int(config: dict, method: str, *names: str) -> int:
    for name in names:
        value = config.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"quantization: {method} {name} must be an integer, got {value!r}")
            return value
    raise ValueError(f"quantization: {method} quantization_config lacks {names[0]}")


def awq_config(config: dict) -> PackedIntConfig:
    """AutoAWQ writes ``w_bit``/``q_group_size``, transformers ``bits``/``group_size``."""
    bits = _required_int(config, "awq", "bits", "w_bit")
    group = _required_int(config, "awq", "group_size", "q_group_size")
    version = str(config.get("version", "gemm")).lower()
    if version not in AWQ_VERSIONS:
        raise ValueError(
            f"quantization: awq version {version!r} is not supported (only {', '.join(AWQ_VERSIONS)})"
        )
    if bits != 4:
        raise ValueError(f"quantization: awq bits {bits} is not supported (only 4)")
    if group <= 0:
        raise ValueError(f"quantization: awq group_size {group} must be positive")
    if config.get("zero_point", True) is not True:
        raise ValueError("quantization: awq zero_point false is not supported (GEMM packing stores zeros)")
    return PackedIntConfig("awq", bits, group)


def gptq_config(config: dict) -> PackedIntConfig:
    bits = _required_int(config, "gptq", "bits")
    group = _required_int(config, "gptq", "group_size")
    if bits not in GPTQ_BITS:
        raise ValueError(f"quantization: gptq bits {bits} is not supported (only 4 and 8)")
    if group <= 0 and group != -1:
        raise ValueError(f"quantization: gptq group_size {group} must be positive or -1")
    checkpoint_format = str(config.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(
            f"quantization: gptq checkpoint_format {checkpoint_format!r} is not supported "
            f"(only {', '.join(GPTQ_FORMATS)})"
        )
    zero_bias = 1 if GPTQ_FORMATS[checkpoint_format] == 1 else 0
    return PackedIntConfig("gptq", bits, None if group == -1 else group, zero_bias)
