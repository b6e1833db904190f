"""``model_impl`` (vLLM's --model-impl) picks the fallback or the native plugin, ``engine plugins``
says which serves a checkpoint, and what the fallback cannot run is refused in one line naming why."""

from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.entrypoints.cli import main
from engine.entrypoints.cli_args import ArgumentParser, add_engine_arguments, engine_options
from engine.interfaces import AttentionKind
from engine.testing import reference

TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
TINY_GPT2 = dict(model_type="gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128)
FALLBACK = "transformers fallback (plugin models-transformers)"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llama"))
    return folder, reference.tiny_checkpoint(folder, "LlamaForCausalLM", TINY_LLAMA)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("gpt2"))
    return folder, reference.tiny_checkpoint(folder, "GPT2LMHeadModel", TINY_GPT2)


def _greedy(llm, prompts, tokens=10):
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_the_model_impl_flag_takes_vllms_values():
    parser = ArgumentParser(prog="engine")
    add_engine_arguments(parser)
    options = engine_options(parser.parse_args(["--model-impl", "vllm"]))
    assert EngineConfig.from_kwargs(**options).model.model_impl == "native"  # vLLM's name for native
    assert EngineConfig.from_kwargs(model_impl="transformers").model.model_impl == "transformers"
    with pytest.raises(ValueError, match="model_impl"):
        EngineConfig.from_kwargs(model_impl="hf")


def test_model_impl_transformers_runs_llama_through_the_fallback_with_the_native_tokens(llama):
    folder, hf_model = llama
    prompts = reference.random_prompts(256, [4, 19, 33, 7], seed=5)
    options = dict(dtype="float32", num_blocks=32, block_size=8, max_num_batched_tokens=16)
    fallback = LLM(folder, model_impl="transformers", **options)
    native = LLM(folder, model_impl="vllm", **options)  # vLLM's spelling of native
    assert type(fallback.engine.model).__name__ == "TransformersForCausalLM"
    assert fallback.engine.model.implementation == FALLBACK
    assert native.engine.model.implementation == "native LlamaForCausalLM (plugin models-llama)"
    got = _greedy(fallback, prompts)
    assert got == _greedy(native, prompts)
    assert got == reference.hf_greedy(hf_model, prompts, 10)


@pytest.mark.parametrize(
    ("architecture", "config", "kinds"),
    [
        (
            "MistralForCausalLM",
            dict(model_type="mistral", sliding_window=16),
            [AttentionKind(sliding_window=16)] * 2,
        ),
        (  # a sliding-window layer and a global one, both with query_pre_attn_scalar's scale
            "Gemma3ForCausalLM",
            dict(
                model_type="gemma3_text",
                head_dim=16,
                sliding_window=16,
                layer_types=["sliding_attention", "full_attention"],
                query_pre_attn_scalar=32,
            ),
            [AttentionKind(sliding_window=16, query_scale=32**-0.5), AttentionKind(query_scale=32**-0.5)],
        ),
    ],
)
def test_attention_kinds_probed_from_the_model_attend_as_transformers(tmp_path, architecture, config, kinds):
    """Each layer's sliding window and query scale come from the probe; prompts longer than the
    window, in chunks that cross its edge, give transformers' greedy tokens."""
    hf_model = reference.tiny_checkpoint(str(tmp_path), architecture, {**TINY_LLAMA, **config})
    llm = LLM(
        str(tmp_path),
        model_impl="transformers",
        dtype="float32",
        num_blocks=64,
        block_size=8,
        max_num_batched_tokens=24,
    )
    assert list(llm.engine.model.kv_layout().layer_kinds) == kinds
    prompts = reference.random_prompts(256, [5, 40, 57, 9], seed=1)
    assert _greedy(llm, prompts) == reference.hf_greedy(hf_model, prompts, 10)


def test_model_impl_native_refuses_an_architecture_no_plugin_claims(gpt2):
    with pytest.raises(
        ValueError, match=r"no installed model plugin serves \['GPT2LMHeadModel'\].*--model-impl"
    ):
        LLM(gpt2[0], dtype="float32", num_blocks=16, model_impl="native")


def test_engine_plugins_names_the_implementation_that_serves_a_checkpoint(llama, gpt2, capsys):
    def line(*args):
        assert main(["plugins", *args]) == 0
        return capsys.readouterr().out.splitlines()[-1]

    assert line("--model", gpt2[0]) == f"model {gpt2[0]}: {FALLBACK}"
    assert line("--model", llama[0]) == f"model {llama[0]}: native LlamaForCausalLM (plugin models-llama)"
    assert line("--model", llama[0], "--model-impl", "transformers") == f"model {llama[0]}: {FALLBACK}"


@pytest.mark.parametrize(
    ("model_type", "architecture", "kwargs", "auto_class", "refusal"),
    [
        # ALiBi Falcon: its position bias rides on the attention mask, which the paged backends do not take
        (
            "falcon",
            "FalconForCausalLM",
            dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True),
            "AutoModelForCausalLM",
            "ALiBi position biases are not supported",
        ),
        # Bloom's modelling code attends by itself, not through transformers' attention interface
        (
            "bloom",
            "BloomForCausalLM",
            dict(hidden_size=64, n_layer=2, n_head=4),
            "AutoModelForCausalLM",
            "does not attend through transformers' attention interface",
        ),
        # an encoder-decoder has no causal-LM class
        (
            "t5",
            "T5ForConditionalGeneration",
            dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4),
            "AutoModelForSeq2SeqLM",
            "no causal-LM class .*'t5'.*encoder-decoder models are not supported",
        ),
    ],
)
def test_what_the_fallback_cannot_run_is_refused_naming_why(
    tmp_path, model_type, architecture, kwargs, auto_class, refusal
):
    config = dict(model_type=model_type, vocab_size=256, **kwargs)
    reference.tiny_checkpoint(str(tmp_path), architecture, config, auto_class=auto_class)
    with pytest.raises(ValueError, match=f"transformers fallback cannot run {architecture}: .*{refusal}"):
        LLM(str(tmp_path), dtype="float32", num_blocks=16)


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        (
            dict(quantization="int8-w8a16"),
            "quantization: int8-w8a16 is not supported by the transformers fallback",
        ),
        (dict(tensor_parallel_size=2), "TransformersForCausalLM is not built of tensor-parallel layers"),
        (dict(enable_lora=True), "enable_lora: TransformersForCausalLM has no layer LoRA can run on"),
    ],
)
def test_quantization_tensor_parallel_and_lora_are_refused_by_name(gpt2, options, refusal):
    with pytest.raises(ValueError, match=refusal):
        LLM(gpt2[0], dtype="float32", num_blocks=16, **options)
