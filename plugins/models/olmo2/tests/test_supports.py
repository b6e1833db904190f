"""What models-olmo2 refuses, it refuses by name before loading anything."""

from transformers import AutoConfig

from engine_models_olmo2.model import Olmo2ForCausalLM


def test_an_mlp_activation_other_than_silu_is_refused_by_name():
    kwargs = dict(Olmo2ForCausalLM.example_configs()["Olmo2ForCausalLM"])
    model_type = kwargs.pop("model_type")
    assert Olmo2ForCausalLM.supports(AutoConfig.for_model(model_type, **kwargs)) == []
    reasons = Olmo2ForCausalLM.supports(AutoConfig.for_model(model_type, **kwargs, hidden_act="gelu"))
    assert len(reasons) == 1 and "'gelu'" in reasons[0]
