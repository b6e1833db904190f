"""For the tests: bitsandbytes checkpoints made by the format's own tooling (transformers'
``BitsAndBytesConfig`` on bitsandbytes' CPU backend), and each layer's reference dequantization
by bitsandbytes (the plugin's ``test`` extra; the method itself never imports it)."""

from __future__ import annotations

import os

import torch

from engine_quant_bitsandbytes.formats import tensor_name

MODES = {
    "nf4-double-quant": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "int8": dict(load_in_8bit=True),
}


def save_quantized(hf_folder: str, folder: str, mode: str) -> None:
    """``hf_folder``'s model loaded through bitsandbytes on the CPU and saved to ``folder``."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(**MODES[mode], bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(
        hf_folder, quantization_config=config, device_map="cpu", dtype=torch.bfloat16
    )
    model.save_pretrained(folder)


def quantized_tensors(weight: torch.Tensor, mode: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One [out, in] weight as bitsandbytes stores it ({name below the weight: tensor}, names
    as saved: ``absmax``, ``quant_state.bitsandbytes__nf4``, ``SCB``...), and the weight
    bitsandbytes dequantizes those tensors to."""
    from bitsandbytes import functional

    weight = weight.to(torch.bfloat16)
    if mode == "int8":
        q, scb, _ = functional.int8_vectorwise_quant(weight.half())
        return {"weight": q, "SCB": scb}, functional.int8_vectorwise_dequant(q, scb).float()
    options = MODES[mode]
    q, state = functional.quantize_4bit(
        weight,
        blocksize=64,
        quant_type=options["bnb_4bit_quant_type"],
        compress_statistics=options.get("bnb_4bit_use_double_quant", False),
    )
    saved = {"weight": q} | state.as_dict(packed=True)
    state.dtype = torch.float32  # bitsandbytes' arithmetic, not rounded to the checkpoint's dtype
    return saved, functional.dequantize_4bit(q, state)


def as_layer_parameters(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``quantized_tensors``' pairs under the names the method loads them by (the checkpoint's
    ``q_proj.weight.absmax`` is ``q_proj.weight_absmax``)."""

    def checkpoint_name(name: str) -> str:
        return f"m.{name}" if name in ("weight", "SCB") else f"m.weight.{name}"

    return [(tensor_name(checkpoint_name(name)).removeprefix("m."), t) for name, t in tensors.items()]


def dequantized_reference(hf_model, folder: str):
    """``hf_model``'s architecture (float32) holding the bitsandbytes checkpoint ``folder``: each
    linear weight as bitsandbytes dequantizes its saved tensors (in float32), the rest as saved."""
    from bitsandbytes import functional
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved = load_file(os.path.join(folder, "model.safetensors"))
    model = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32).eval()
    state = hf_model.state_dict()
    for name in state:
        if not name.endswith("_proj.weight"):
            state[name] = saved[name].float()  # as saved: rounded to the checkpoint's dtype
            continue
        if name.removesuffix("weight") + "SCB" in saved:
            scb = saved[name.removesuffix("weight") + "SCB"]
            state[name] = functional.int8_vectorwise_dequant(saved[name], scb)
            continue
        below = {
            key.removeprefix(f"{name}."): value for key, value in saved.items() if key.startswith(f"{name}.")
        }
        quant_state = functional.QuantState.from_dict(below, device=torch.device("cpu"))
        quant_state.dtype = torch.float32  # bitsandbytes' arithmetic, not rounded to the checkpoint's dtype
        state[name] = functional.dequantize_4bit(saved[name], quant_state)
    model.load_state_dict(state)
    return model
