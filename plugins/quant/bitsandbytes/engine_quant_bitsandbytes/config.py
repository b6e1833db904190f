"""Reading a bitsandbytes ``quantization_config``: what the saved tensors mean, each setting
that changes it checked at start-up and a bad one refused in one line naming it."""

from __future__ import annotations

QUANT_TYPES = ("nf4", "fp4")


def storage_mode(config: dict) -> str:
    """ "nf4", "fp4" (4-bit) or "int8" (8-bit, LLM.int8's row-wise format)."""
    four, eight = bool(config.get("load_in_4bit")), bool(config.get("load_in_8bit"))
    if four == eight:
        raise ValueError(
            "quantization: bitsandbytes quantization_config sets "
            + ("both load_in_4bit and load_in_8bit" if four else "neither load_in_4bit nor load_in_8bit")
        )
    if eight:
        if config.get("llm_int8_has_fp16_weight"):
            raise ValueError(
                "quantization: bitsandbytes llm_int8_has_fp16_weight true keeps float weights for "
                "training; such a checkpoint is not an 8-bit one"
            )
        return "int8"
    quant_type = str(config.get("bnb_4bit_quant_type", "fp4")).lower()
    if quant_type not in QUANT_TYPES:
        raise ValueError(
            f"quantization: bitsandbytes bnb_4bit_quant_type {quant_type!r} is not one of "
            + ", ".join(QUANT_TYPES)
        )
    storage = str(config.get("bnb_4bit_quant_storage", "uint8")).removeprefix("torch.")
    if storage != "uint8":
        raise ValueError(
            f"quantization: bitsandbytes bnb_4bit_quant_storage {storage!r} is not supported (only uint8)"
        )
    return quant_type
