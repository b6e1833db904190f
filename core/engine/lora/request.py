"""``LoRARequest`` where vLLM users import it from (``vllm.lora.request``)."""

from engine.messages.lora import LoRARequest

__all__ = ["LoRARequest"]
