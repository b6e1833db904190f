"""Random PEFT adapters over the default model, saved as PEFT saves them: the LoRA
benchmarks' adapters (``lora.py``, ``vs_vllm.py online --lora``)."""

from __future__ import annotations

import os

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapters(folder: str, count: int, rank: int) -> list[str]:
    """``count`` random PEFT adapters over the default model's architecture, ranks alternating
    ``rank`` and ``rank // 2``; their folders."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from engine_quant_gguf.loader import GGUFLoader, default_model_path

    hf_config = GGUFLoader(default_model_path()).hf_config()
    base = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    paths, models = [], {}
    gen = torch.Generator().manual_seed(0)
    for i in range(count):
        r = rank if i % 2 == 0 else max(1, rank // 2)
        if r not in models:
            config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS)
            models[r] = peft.get_peft_model(base, config, adapter_name=f"r{r}")
            base = models[r].get_base_model()
        model = models[r]
        with torch.no_grad():
            for name, param in model.named_parameters():
                if f"lora_A.r{r}." in name or f"lora_B.r{r}." in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        path = os.path.join(folder, f"adapter-{i}")
        model.save_pretrained(path, selected_adapters=[f"r{r}"])
        nested = os.path.join(path, f"r{r}")  # peft saves a named adapter in its own subfolder
        paths.append(nested if os.path.isdir(nested) else path)
    return paths
