"""Planted bugs: the Llama model with one mistake each, the mistakes model authors make: each
loads and runs and is wrong in numbers only, two of them only on a config whose rope base or
eps differs from Llama's default, which the llama plugin's example configs keep. Each class
claims an architecture of its own, with the llama plugin's example configs it needs, so the
engine serves it the checkpoints the model kit writes for it. Not registered by the suite's
conftest: ``tests/test_model_kit_mutations.py`` registers them in a child pytest that runs the
model kit on each, and checks that it fails."""

from __future__ import annotations

import copy

from engine import hookimpl
from engine.layers.loading import FUSED_PROJECTIONS, decoder_rename, load_checkpoint
from engine.layers.rotary import RotaryEmbedding
from engine_models_llama.model import LlamaForCausalLM


def _claiming(architecture: str, *keys: str) -> type:
    """The Llama model as ``architecture``, with the llama plugin's example configs ``keys``."""

    def example_configs(cls):
        configs = LlamaForCausalLM.example_configs()
        return {f"{architecture}-{key}": configs[key] for key in keys}

    attrs = {"architectures": (architecture,), "example_configs": classmethod(example_configs)}
    return type(architecture, (LlamaForCausalLM,), attrs)


Llama = _claiming("KitLlamaForCausalLM", "LlamaForCausalLM", "LlamaForCausalLM-llama3-rope-tied")


def _rotary(model, **rope) -> None:
    """Replace ``model``'s rotary tables by ones built from its config with ``rope`` changed."""
    cfg = copy.copy(model.cfg)
    cfg.rope_parameters = {**model.cfg.rope_parameters, **rope}
    old = model.model.rotary
    model.model.rotary = RotaryEmbedding(cfg, cfg.max_position_embeddings, old.cos.dtype, old.ops)


class RopeBase10000(_claiming("RopeBaseMutantForCausalLM", "LlamaForCausalLM")):
    """Rotary frequencies from Llama-2's base 10000, not the config's ``rope_theta``."""

    def __init__(self, ctx):
        super().__init__(ctx)
        _rotary(self, rope_theta=10000.0)


class RopeScalingIgnored(_claiming("RopeScalingMutantForCausalLM", "LlamaForCausalLM-llama3-rope-tied")):
    """Reads the rope base but not the scaling type: llama3's stretched long wavelengths are lost."""

    def __init__(self, ctx):
        super().__init__(ctx)
        _rotary(self, rope_type="default")


class EpsHardCoded(_claiming("EpsMutantForCausalLM", "LlamaForCausalLM")):
    """Builds each layer's norms with Llama's default eps 1e-6, not the config's ``rms_norm_eps``."""

    def decoder_layer(self, cfg, index, method, dtype, ops):
        cfg = copy.copy(cfg)
        cfg.rms_norm_eps = 1e-6
        return super().decoder_layer(cfg, index, method, dtype, ops)


class KVSwapped(_claiming("KVSwapMutantForCausalLM", "LlamaForCausalLM")):
    """Maps ``k_proj`` and ``v_proj`` to each other's shard of the fused q|k|v projection (under
    GQA both are num_kv_heads x head_dim rows, so it loads)."""

    def load_weights(self, weights):
        swapped = FUSED_PROJECTIONS | {"k_proj": ("qkv_proj", 2), "v_proj": ("qkv_proj", 1)}
        load_checkpoint(self, weights, decoder_rename(self.tied), fused=swapped)


MUTANTS = {
    "rope-base-10000": RopeBase10000,
    "rope-scaling-ignored": RopeScalingIgnored,
    "eps-hard-coded": EpsHardCoded,
    "k-v-swapped": KVSwapped,
}


@hookimpl
def register_models(register):
    for model in [Llama, *MUTANTS.values()]:
        register(model.architectures[0], model, api=2)
