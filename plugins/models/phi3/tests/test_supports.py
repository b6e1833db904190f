"""What models-phi3 refuses, it refuses by name before loading anything."""

from transformers import AutoConfig

from engine_models_phi3.model import Phi3ForCausalLM


def test_an_mlp_activation_other_than_silu_is_refused_by_name():
    kwargs = dict(Phi3ForCausalLM.example_configs()["Phi3ForCausalLM"])
    model_type = kwargs.pop("model_type")
    assert Phi3ForCausalLM.supports(AutoConfig.for_model(model_type, **kwargs)) == []
    reasons = Phi3ForCausalLM.supports(AutoConfig.for_model(model_type, **kwargs, hidden_act="gelu"))
    assert len(reasons) == 1 and "'gelu'" in reasons[0]
