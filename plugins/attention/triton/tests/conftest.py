"""The tiny random Llama this plugin's engine-level tests run (interpreted on the CPU, compiled on a GPU)."""

import pytest

from engine.testing import reference


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny"))
    reference.tiny_checkpoint(
        folder,
        "LlamaForCausalLM",
        dict(
            model_type="llama",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        ),
    )
    return folder
