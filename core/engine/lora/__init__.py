"""LoRA adapters over one base model (vLLM's ``vllm.lora``): ``LoRARequest`` names the adapter a
request runs with; :mod:`engine.lora.adapter` reads PEFT adapters, :mod:`engine.lora.manager`
keeps them loaded and in the model's slots. The batched op is the platform's
(:meth:`engine.layers.LayerOps.lora_shrink`, ``lora_expand``)."""

from engine.messages.lora import LoRARequest

__all__ = ["LoRARequest"]
