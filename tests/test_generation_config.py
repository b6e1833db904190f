"""The model's generation_config.json supplies the default sampling parameters, as vLLM's
``--generation-config auto``: a request that leaves a field out gets the file's value, one
that sets it keeps its own; ``vllm`` ignores the file; a folder path reads that folder's.
Offline (``LLM.get_default_sampling_params``) and served (``engine serve``, ``/v1/models``)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.serving import serve

GENERATION_CONFIG = {"temperature": 0.0, "max_new_tokens": 5, "bos_token_id": 1, "do_sample": False}
DEFAULTS = {"temperature": 0.0, "max_tokens": 5}  # the keys that are sampling parameters
PROMPT = "The robot said"
OPTIONS = {"dtype": "float32", "num_blocks": 64, "block_size": 16, "max_model_len": 256}
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=5)


@pytest.fixture(scope="module")
def greedy_checkpoint(tiny_llama, tmp_path_factory):
    """The tiny Llama with a generation config asking for greedy decoding and 5 tokens."""
    folder = tmp_path_factory.mktemp("generation-config") / "model"
    shutil.copytree(tiny_llama[0], folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return str(folder)


@pytest.fixture(scope="module")
def auto(greedy_checkpoint):
    return LLM(greedy_checkpoint, **OPTIONS)


@pytest.fixture(scope="module")
def ignoring(greedy_checkpoint):
    return LLM(greedy_checkpoint, generation_config="vllm", **OPTIONS)


def token_ids(llm: LLM, params: SamplingParams | None = None) -> list[int]:
    return llm.generate(PROMPT, params)[0].outputs[0].token_ids


def test_auto_defaults_apply_to_requests_without_params(auto, ignoring):
    assert auto.get_default_sampling_params() == SamplingParams(**DEFAULTS)
    greedy = token_ids(ignoring, SamplingParams(temperature=0.0, max_tokens=5))
    assert token_ids(auto) == greedy
    assert token_ids(auto, SAMPLED) == token_ids(ignoring, SAMPLED) != greedy  # set fields are kept


def test_vllm_mode_ignores_the_file(ignoring):
    assert ignoring.get_default_sampling_params() == SamplingParams()
    assert len(token_ids(ignoring)) == SamplingParams().max_tokens


def test_a_folder_supplies_the_generation_config(tiny_llama, greedy_checkpoint):
    llm = LLM(tiny_llama[0], generation_config=greedy_checkpoint, **OPTIONS)
    assert llm.get_default_sampling_params() == SamplingParams(**DEFAULTS)
    with pytest.raises(ValueError, match="generation_config: no generation_config.json"):
        LLM(tiny_llama[0], generation_config=str(tiny_llama[0] + "/.."), **OPTIONS)


def test_a_bad_value_names_the_generation_config(tmp_path, tiny_llama):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config: temperature"):
        LLM(tiny_llama[0], generation_config=str(tmp_path), **OPTIONS)


def test_served_requests_get_the_defaults(greedy_checkpoint, ignoring):
    greedy = ignoring.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0]
    sampled = ignoring.generate(PROMPT, SAMPLED)[0].outputs[0]
    with serve(
        greedy_checkpoint,
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--num-blocks",
        "64",
        "--max-model-len",
        "256",
        api_key=None,
    ) as server:
        client = server.openai()
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]
        assert model["default_sampling_params"] == DEFAULTS
        # completions keep OpenAI's (and vLLM's) max_tokens default of 16; chat has none but the config's
        plain = client.completions.create(model="tiny", prompt=PROMPT)
        assert plain.choices[0].text == greedy.text and plain.usage.completion_tokens == 16
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
        assert chat.usage.completion_tokens == 5
        own = client.completions.create(model="tiny", prompt=PROMPT, temperature=1.0, seed=7, max_tokens=5)
        assert own.choices[0].text == sampled.text != greedy.text
    log = server.process.stdout.read()
    assert "default sampling parameters from the model's generation config" in log
