"""LoRARequest: which adapter a request runs with, spelled as vLLM spells it
(``LoRARequest(lora_name, lora_int_id, lora_path)``). It is data only: the engine loads the
adapter behind it (:mod:`engine.lora`)."""

from __future__ import annotations

from typing import Any

import attrs


def _positive_id(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"lora_int_id must be a positive integer, got {value!r}")


def _named(instance, attribute, value):
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} must be a non-empty string, got {value!r}")


@attrs.frozen
class LoRARequest:
    """``lora_int_id`` is the adapter's identity in the engine (its slot, its prefix-cache key,
    the ``lora_id`` of KV events): two requests with the same id use the same adapter.
    ``lora_path``: a folder as PEFT's ``save_pretrained`` writes it."""

    lora_name: str = attrs.field(validator=_named)
    lora_int_id: int = attrs.field(validator=_positive_id)
    lora_path: str = attrs.field(validator=_named)

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> LoRARequest:
        return cls(**value)
