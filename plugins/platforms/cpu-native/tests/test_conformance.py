"""platforms-cpu-native: its layer ops against the core's contract, the same greedy tokens
as the plain CPU platform on a tiny model, and a clear refusal where it cannot build."""

import json
import os
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from engine.testing.layer_ops import LayerOpsContract
from engine.testing.reference import random_prompts, tiny_checkpoint
from engine_platforms_cpu_native import build


class TestCpuNativeLayerOps(LayerOpsContract):
    platform_name = "cpu-native"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny"))
    tiny_checkpoint(folder, "LlamaForCausalLM", dict(
        model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    return folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_greedy_tokens_as_the_plain_cpu_platform(tiny_model, dtype):
    prompts = random_prompts(256, [5, 17, 30], seed=3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens = {}
    for device in ("cpu", "cpu-native"):
        llm = LLM(tiny_model, dtype=dtype, device=device, max_model_len=256)
        assert llm.engine.platform.name == device
        tokens[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["cpu-native"] == tokens["cpu"]


def test_chosen_over_cpu_when_installed():
    from engine.testing import select_platform

    assert select_platform().name == "cpu-native"


def test_missing_compiler_is_a_reason_and_cpu_is_chosen(tmp_path):
    with pytest.raises(build.BuildError, match="no C compiler"):
        build.load_source(build.SOURCE, "no-such-compiler")
    script = ("import json; from engine.testing import select_platform;"
              "from engine_platforms_cpu_native.platform import NativeCpuPlatform as P;"
              "print(json.dumps([P.unavailable_reasons(), select_platform().name]))")
    env = dict(os.environ, CC="no-such-compiler", XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    reasons, chosen = json.loads(out.stdout.strip().splitlines()[-1])
    assert chosen == "cpu" and "no C compiler" in reasons[0]
