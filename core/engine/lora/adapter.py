"""PEFT LoRA adapters as saved by ``save_pretrained``: ``adapter_config.json`` and
``adapter_model.safetensors``, read into the shape the engine's fused layers take.

An adapter's ``q_proj``/``k_proj``/``v_proj`` land on the shards of the fused ``qkv_proj``,
``gate_proj``/``up_proj`` on ``gate_up_proj``; ``o_proj`` and ``down_proj`` are their own
layers. Each adapted projection keeps its A [r, in], B [out, r] and scale: ``lora_alpha / r``,
or ``lora_alpha / √r`` with rsLoRA, per module where ``rank_pattern`` / ``alpha_pattern`` say
so. What the engine cannot serve exactly is refused with the reason, never half-applied:
embedding or LM-head targets (extra vocabulary), ``modules_to_save``, DoRA, LoRA biases, a rank
above ``max_lora_rank``, a target the model lacks, a shape that is not the model's, a file that
is missing, corrupt or truncated."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import attrs
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.messages.lora import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# a PEFT target -> (the engine's fused layer, shard)
FUSED_TARGETS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
VOCABULARY_TARGETS = ("embed_tokens", "lm_head")
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")

# A fused layer's (A [r, in], B [out, r], scale) per shard; None where the adapter leaves it out.
Shard = tuple[torch.Tensor, torch.Tensor, float] | None


class LoRAAdapterError(ValueError):
    """An adapter the engine refuses: the message names the adapter and the reason."""


@attrs.frozen
class LoRAAdapter:
    request: LoRARequest
    rank: int  # the largest rank of any adapted module
    layers: dict[str, tuple[Shard, ...]]  # the engine's layer name -> its shards

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id


def load_adapter(
    request: LoRARequest, targets: dict[str, tuple[int, tuple[int, ...]]], max_rank: int
) -> LoRAAdapter:
    """Read and check the adapter at ``request.lora_path`` against ``targets``: each layer LoRA
    may run on, by its module name in the engine's model, with (input size, fused output
    sizes). Raises :class:`LoRAAdapterError`."""
    folder = Path(request.lora_path)
    fail = _failure(request)
    config = _read_config(folder, fail)
    weights = _read_weights(folder, fail)
    pairs = _pairs(weights, fail)
    layers: dict[str, list[Shard]] = {}
    rank = 0
    for module, (a, b) in sorted(pairs.items()):
        layer, shard = _fused(module, targets, fail)
        input_size, output_sizes = targets[layer]
        r = _check_shapes(module, a, b, input_size, output_sizes[shard], max_rank, fail)
        rank = max(rank, r)
        shards = layers.setdefault(layer, [None] * len(output_sizes))
        shards[shard] = (a, b, _scale(config, module, r))
    if not layers:
        raise fail("its safetensors file holds no lora_A / lora_B weights")
    return LoRAAdapter(request, rank, {name: tuple(shards) for name, shards in layers.items()})


def _failure(request: LoRARequest):
    def fail(reason: str) -> LoRAAdapterError:
        return LoRAAdapterError(
            f"LoRA adapter {request.lora_name!r} (id {request.lora_int_id}, {request.lora_path}): {reason}"
        )

    return fail


def _read_config(folder: Path, fail) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise fail(f"no {CONFIG_FILE} (a folder as PEFT's save_pretrained writes it)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise fail(f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise fail(f"{CONFIG_FILE} is not a JSON object")
    refusals = {
        "peft_type": (config.get("peft_type", "LORA") not in ("LORA", None), "is not a LoRA adapter"),
        "use_dora": (bool(config.get("use_dora")), "DoRA adapters are not supported"),
        "bias": (config.get("bias", "none") not in ("none", None), "LoRA biases are not supported"),
        "modules_to_save": (
            bool(config.get("modules_to_save")),
            "modules_to_save (whole modules saved beside the adapter) are not supported",
        ),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "fan_in_fan_out weights are not supported"),
    }
    for key, (refused, reason) in refusals.items():
        if refused:
            raise fail(f"{reason} ({key}={config.get(key)!r})")
    if not isinstance(config.get("r"), int) or not isinstance(config.get("lora_alpha"), int | float):
        raise fail(f"{CONFIG_FILE} lacks r or lora_alpha")
    return config


def _read_weights(folder: Path, fail) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        pickled = (folder / "adapter_model.bin").exists()
        raise fail(
            f"no {WEIGHTS_FILE}" + (" (adapter_model.bin is not read: safetensors only)" if pickled else "")
        )
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise fail(f"{WEIGHTS_FILE} is corrupt or truncated ({exc})") from None


def _pairs(weights: dict[str, torch.Tensor], fail) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT module name (``model.layers.0.self_attn.q_proj``) -> (A, B)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        name = key.removeprefix(PEFT_PREFIX)
        if any(part in VOCABULARY_TARGETS for part in name.split(".")) or "lora_embedding" in name:
            raise fail(
                f"it adapts the token embeddings or the LM head ({key}): extra vocabulary and "
                "embedding adapters are not supported"
            )
        match = _KEY.match(name)
        if match is None:
            raise fail(f"unexpected tensor {key} (only lora_A / lora_B weights are served)")
        halves.setdefault(match["module"], {})[match["half"]] = tensor
    pairs = {}
    for module, found in halves.items():
        if set(found) != {"A", "B"}:
            raise fail(f"{module} has lora_{''.join(found)} without its other half")
        pairs[module] = (found["A"], found["B"])
    return pairs


def _fused(module: str, targets: dict, fail) -> tuple[str, int]:
    parent, _, leaf = module.rpartition(".")
    if leaf not in FUSED_TARGETS:
        raise fail(f"it targets {module}; LoRA serves only {', '.join(FUSED_TARGETS)}")
    fused, shard = FUSED_TARGETS[leaf]
    layer = f"{parent}.{fused}" if parent else fused
    if layer not in targets:
        raise fail(f"it targets {module}, which the base model lacks")
    return layer, shard


def _check_shapes(module, a, b, input_size: int, output_size: int, max_rank: int, fail) -> int:
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise fail(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not pair")
    rank = a.shape[0]
    if rank > max_rank:
        raise fail(f"{module} has rank {rank}, above max_lora_rank={max_rank}")
    if a.shape[1] != input_size or b.shape[0] != output_size:
        raise fail(
            f"{module}: its shape [{b.shape[0]} x {a.shape[1]}] (out x in) does not match the base "
            f"model's [{output_size} x {input_size}]"
        )
    return rank


def _scale(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling: ``lora_alpha / r``, or ``lora_alpha / √r`` with rsLoRA (``use_rslora``);
    ``alpha_pattern`` overrides the alpha of the modules it matches (the rank is the weights')."""
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _pattern_value(pattern: dict, module: str, default):
    """The value of the first pattern key matching ``module`` as PEFT matches them: the key
    is a regular expression for the name's tail, after a dot or the whole name."""
    for key, value in pattern.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default
