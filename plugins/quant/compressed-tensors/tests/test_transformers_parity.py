"""A tiny random Llama written as compressed-tensors checkpoints, served by the engine, against
``transformers`` running the same checkpoint by the format's reference math in float32: every
linear weight dequantized by plain torch (:mod:`engine_quant_compressed_tensors.checkpoint`), and
where the checkpoint quantizes activations (static W8A8, NVFP4 W4A4) each projection's input
rounded first, as compressed-tensors' forward rounds it. (transformers' own compressed-tensors
integration needs the ``compressed-tensors`` library, which this environment does not carry.)

On the plain ``cpu`` platform (NVFP4 on ``cpu-native``, whose FP4 kernel runs its weights) the
log-probabilities agree within float tolerance and the greedy tokens are the same."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing import reference, select_platform
from engine.testing.quant import TINY_LLAMA, prompt_logprobs, write_quantized_checkpoint
from engine_quant_compressed_tensors import checkpoint
from engine_quant_compressed_tensors.kernels import fp4_probe


def _calibrated_max(weight: torch.Tensor) -> float:
    """A stand-in for the largest input magnitude calibration saw, which the checkpoint's input
    scales come from: it differs between q_proj (256 rows) and k/v (128), as each projection's
    own observer makes it, so fused layers must keep each shard's."""
    return 2 + weight.shape[0] / 128


ATTENTION = r"re:.*self_attn\.(q|k|v|o)_proj$"
FORMATS = {
    "w4a16-group128": (
        lambda w: checkpoint.packed_tensors(w, 4, 128),
        lambda t: checkpoint.dequantize_packed(t, 4),
        checkpoint.config("pack-quantized", checkpoint.int_weights(4, 128)),
    ),
    "w4a16-asymmetric-group32-down-proj-ignored": (  # down_proj, the only one of 512 inputs, stays float
        lambda w: (
            {"weight": w} if w.shape[1] == 512 else checkpoint.packed_tensors(w, 4, 32, symmetric=False)
        ),
        lambda t: t["weight"] if "weight" in t else checkpoint.dequantize_packed(t, 4),
        checkpoint.config(
            "pack-quantized",
            checkpoint.int_weights(4, 32, symmetric=False),
            ignore=["lm_head", "re:.*down_proj$"],
        ),
    ),
    "mixed-w4a16-attention-w8a8-static-mlp": (  # the MLP's weights, alone, have 512 rows or inputs
        lambda w: (
            checkpoint.int8_tensors(w, _calibrated_max(w) / 127)
            if 512 in w.shape
            else checkpoint.packed_tensors(w, 4, 32)
        ),
        lambda t: checkpoint.dequantize_int8(t) if "weight" in t else checkpoint.dequantize_packed(t, 4),
        checkpoint.mixed_config(
            {  # attention by name, before the MLP's group by class
                "group_0": checkpoint.group(
                    "int-quantized",
                    checkpoint.int_weights(8, None),
                    checkpoint.activations("int", dynamic=False),
                ),
                "group_1": checkpoint.group(
                    "pack-quantized", checkpoint.int_weights(4, 32), targets=[ATTENTION]
                ),
            }
        ),
    ),
    "w8a8-static": (
        lambda w: checkpoint.int8_tensors(w, _calibrated_max(w) / 127),
        checkpoint.dequantize_int8,
        checkpoint.config(
            "int-quantized", checkpoint.int_weights(8, None), checkpoint.activations("int", dynamic=False)
        ),
    ),
    "fp8-channel": (
        lambda w: checkpoint.fp8_tensors(w, "channel"),
        lambda t: checkpoint.dequantize_fp8(t, "channel"),
        checkpoint.config("float-quantized", checkpoint.float_weights("channel")),
    ),
    "nvfp4-w4a4": (
        lambda w: checkpoint.nvfp4_tensors(w, 448 * 6 / _calibrated_max(w)),
        checkpoint.dequantize_nvfp4,
        checkpoint.config("nvfp4-pack-quantized", checkpoint.NVFP4_WEIGHTS, checkpoint.NVFP4_ACTIVATIONS),
    ),
    "nvfp4a16": (
        checkpoint.nvfp4_tensors,
        checkpoint.dequantize_nvfp4,
        checkpoint.config("nvfp4-pack-quantized", checkpoint.NVFP4_WEIGHTS),
    ),
}
COMMON = dict(dtype="float32", num_blocks=40, block_size=8, max_model_len=128)
FP4_KERNEL = ("nvfp4-w4a4", "nvfp4a16")  # served on cpu-native: the FP4 kernel, not the dequantized weight
PROMPTS = reference.random_prompts(TINY_LLAMA["vocab_size"], [9, 23], seed=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hf"))
    return folder, reference.tiny_checkpoint(folder, "LlamaForCausalLM", TINY_LLAMA, seed=4)


def _round_int8(scale: float):
    return lambda x: (x / scale).round().clamp(-128, 127) * scale


def _round_nvfp4(global_scale: float):
    return lambda x: checkpoint.fake_quantize_nvfp4(x, global_scale)


# checkpoint tensor of the calibrated input scale -> how the reference rounds a projection's input
INPUT_ROUNDING = {"input_scale": _round_int8, "input_global_scale": _round_nvfp4}


def reference_model(hf_model, quantize, dequantize):
    """``hf_model`` with every projection's weight replaced by its plain dequantization, and its
    input rounded as compressed-tensors' forward rounds it where the checkpoint quantizes
    activations (static int8 on ``input_scale``, NVFP4 over ``input_global_scale``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32).eval()
    state = hf_model.state_dict()
    rounding = {}
    for name, value in state.items():
        if name.endswith("_proj.weight"):
            tensors = quantize(value)
            state[name] = dequantize(tensors)
            for scale_name, round_input in INPUT_ROUNDING.items():
                if scale_name in tensors:
                    rounding[name.removesuffix(".weight")] = round_input(float(tensors[scale_name]))
    model.load_state_dict(state)
    for name, round_input in rounding.items():
        model.get_submodule(name).register_forward_pre_hook(
            lambda module, args, round_input=round_input: (round_input(args[0]),)
        )
    return model


@pytest.fixture(scope="module", params=list(FORMATS))
def served(request, tiny, tmp_path_factory):
    """(checkpoint folder, the platform serving it, transformers model on its reference math)."""
    quantize, dequantize, config = FORMATS[request.param]
    hf_folder, hf_model = tiny
    folder = str(tmp_path_factory.mktemp(request.param))
    write_quantized_checkpoint(hf_folder, folder, quantize, config)
    device = "cpu-native" if request.param in FP4_KERNEL else "cpu"
    if device == "cpu-native":
        assert fp4_probe(select_platform(device)) == "fp4", "cpu-native offers no FP4 kernel here"
    return folder, device, reference_model(hf_model, quantize, dequantize)


def test_logprobs_and_greedy_equal_transformers_on_the_reference_math(served):
    folder, device, hf_model = served
    llm = LLM(folder, device=device, **COMMON)
    for ids, got in zip(PROMPTS, prompt_logprobs(llm, PROMPTS)):
        want = reference.hf_logprobs(hf_model, ids)[:-1]
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == reference.hf_greedy(hf_model, PROMPTS, 12)
