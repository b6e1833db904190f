"""What models-moe refuses, each with its reason."""

from transformers import AutoConfig

from engine_models_moe.model import MoeForCausalLM


def config(model_type: str, **kwargs):
    return AutoConfig.for_model(model_type, **kwargs)


def test_example_configs_are_served():
    for key, kwargs in MoeForCausalLM.example_configs().items():
        kwargs = dict(kwargs)
        assert MoeForCausalLM.supports(config(kwargs.pop("model_type"), **kwargs)) == [], key


def test_unsupported_configs_name_the_reason():
    assert "sliding-window" in MoeForCausalLM.supports(config("mixtral", sliding_window=4096))[0]
    assert (
        "sliding-window"
        in MoeForCausalLM.supports(config("qwen3_moe", use_sliding_window=True, sliding_window=4096))[0]
    )
    assert "hidden_act 'gelu'" in MoeForCausalLM.supports(config("mixtral", hidden_act="gelu"))[0]
    assert "is not one of" in MoeForCausalLM.supports(config("llama"))[0]
