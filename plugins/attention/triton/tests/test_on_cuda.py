"""attention-triton compiled and run on a CUDA device (skipped without one): the whole
attention contract at the block sizes it serves, a tiny Llama's greedy tokens against the
torch backend's in float32, and its decode steps replayed from CUDA graphs against eager."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.builtin.platforms import CudaPlatform
from engine.testing import reference
from engine.testing.attention import AttentionBackendContract

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class TestTritonOnCuda(AttentionBackendContract):
    backend_name = "triton"
    platform_cls = CudaPlatform
    block_sizes = (16, 32, 64)


def _generate(folder, **options):
    prompts = reference.random_prompts(256, [5, 40, 16, 3, 70], seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 20, 7, 16, 9)]
    llm = LLM(
        folder,
        dtype="float32",
        device="cuda",
        block_size=16,
        max_model_len=128,
        max_num_batched_tokens=32,
        **options,
    )
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_greedy_tokens_match_the_torch_backend(tiny_model):
    _, torch_tokens = _generate(tiny_model, attention_backend="torch", enforce_eager=True)
    _, triton_tokens = _generate(tiny_model, attention_backend="triton", enforce_eager=True)
    assert triton_tokens == torch_tokens


def test_cuda_graph_decode_gives_the_eager_tokens(tiny_model):
    llm, graph_tokens = _generate(tiny_model, attention_backend="triton", cuda_graph_sizes=(1, 2, 4, 8))
    assert llm.engine.runner.graphs is not None and sorted(llm.engine.runner.graphs.graphs) == [1, 2, 4, 8]
    _, eager_tokens = _generate(tiny_model, attention_backend="triton", enforce_eager=True)
    assert graph_tokens == eager_tokens
