"""gpt-oss checkpoints with MXFP4 experts, as gpt-oss ships them: the tiny random model's experts
packed into ``*_blocks`` / ``*_scales`` (quant method "mxfp4"; attention, router, embeddings and
LM head left in float), loaded through quant-mxfp4 and kept packed; log-probs and greedy tokens
against ``transformers`` running the weights ``transformers``' own MXFP4 code dequantizes."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from engine.testing import reference
from engine_models_gpt_oss.model import GptOssForCausalLM

mxfp4_format = pytest.importorskip("engine_quant_mxfp4.format", reason="needs tessellm-quant-mxfp4")
convert_moe_packed_tensors = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors

PROJECTIONS = ("gate_up_proj", "down_proj")


def pack_experts(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float expert tensor as transformers holds it, [E, in, out], -> gpt-oss's
    (``_blocks`` [E, out, in/32, 16], ``_scales`` [E, out, in/32])."""
    packed = [mxfp4_format.quantize(expert.t().contiguous()) for expert in stacked]
    return (
        torch.stack([p["weight_blocks"] for p in packed]),
        torch.stack([p["weight_scales"] for p in packed]),
    )


def save_mxfp4_checkpoint(folder: str, hf_model) -> None:
    """Rewrite ``folder`` (``hf_model`` saved there) with MXFP4 experts, and load the weights
    transformers dequantizes from them into ``hf_model``, the reference."""
    tensors = {}
    for name, tensor in hf_model.state_dict().items():
        prefix, _, suffix = name.rpartition(".")
        if suffix not in PROJECTIONS or not prefix.endswith(".experts"):
            tensors[name] = tensor.contiguous()
            continue
        blocks, scales = pack_experts(tensor)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        with torch.no_grad():
            tensor.copy_(convert_moe_packed_tensors(blocks, scales, dtype=tensor.dtype))
    os.remove(os.path.join(folder, "model.safetensors"))
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "lm_head"],
    }
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("gpt-oss-mxfp4"))
    kwargs = GptOssForCausalLM.example_configs()["GptOssForCausalLM"]
    hf_model = reference.tiny_checkpoint(folder, "GptOssForCausalLM", kwargs)
    reference.randomize_norms(hf_model, folder, also=("sinks", "router.bias", "_proj_bias"))
    save_mxfp4_checkpoint(folder, hf_model)
    return folder, hf_model


def _expert_projections(model):
    for layer in model.model.layers:
        yield layer.mlp.experts.gate_up
        yield layer.mlp.experts.down


def test_mxfp4_experts_stay_packed_and_match_transformers(checkpoint):
    from engine import LLM, SamplingParams

    folder, hf_model = checkpoint
    # the plain cpu platform: its MXFP4 matmul is exact (cpu-native's packed kernel rounds the
    # activations to int8, which the quant kit bounds, not this parity)
    llm = LLM(folder, dtype="float32", num_blocks=64, block_size=8, max_num_batched_tokens=24, device="cpu")
    for projection in _expert_projections(llm.engine.model):
        assert type(projection.method).__name__ == "Mxfp4LinearMethod"
        assert not hasattr(projection, "weight"), "MXFP4 experts are kept packed, never dequantized"
    prompts = reference.random_prompts(hf_model.config.vocab_size, [5, 17, 30], seed=1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=-1, temperature=0))
    for ids, out in zip(prompts, outs):
        expected = reference.hf_logprobs(hf_model, ids)
        got = torch.stack(
            [torch.tensor([e[t].logprob for t in range(len(e))]) for e in out.prompt_logprobs[1:]]
        )
        torch.testing.assert_close(got, expected[: len(got)], atol=1e-3, rtol=0)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == reference.hf_greedy(hf_model, prompts, 8)
