"""What models-granite refuses, it refuses by name before loading anything."""

from transformers import AutoConfig

from engine_models_granite.model import GraniteForCausalLM


def test_an_mlp_activation_other_than_silu_is_refused_by_name():
    kwargs = dict(GraniteForCausalLM.example_configs()["GraniteForCausalLM"])
    model_type = kwargs.pop("model_type")
    assert GraniteForCausalLM.supports(AutoConfig.for_model(model_type, **kwargs)) == []
    reasons = GraniteForCausalLM.supports(AutoConfig.for_model(model_type, **kwargs, hidden_act="gelu"))
    assert len(reasons) == 1 and "'gelu'" in reasons[0]
