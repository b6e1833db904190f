"""What models-glm4 refuses, it refuses by name before loading anything."""

from transformers import AutoConfig

from engine_models_glm4.model import Glm4ForCausalLM


def test_an_mlp_activation_other_than_silu_is_refused_by_name():
    kwargs = dict(Glm4ForCausalLM.example_configs()["Glm4ForCausalLM"])
    model_type = kwargs.pop("model_type")
    assert Glm4ForCausalLM.supports(AutoConfig.for_model(model_type, **kwargs)) == []
    reasons = Glm4ForCausalLM.supports(AutoConfig.for_model(model_type, **kwargs, hidden_act="gelu"))
    assert len(reasons) == 1 and "'gelu'" in reasons[0]
