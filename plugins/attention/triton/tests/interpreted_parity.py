"""A tiny random Llama through ``LLM(..., attention_backend="triton")`` on the CPU under
Triton's interpreter gives the torch backend's greedy tokens in float32 (whole prompts and
chunks of 16 — later chunks beside decode rows — then decode rows), and the same tokens when
its decode steps are replayed over the static buffers of the CUDA graph runner. Not collected
by itself (``TRITON_INTERPRET=1`` must be set first): ``test_conformance.py`` runs it in a
child process."""

import pytest

from engine import LLM, SamplingParams
from engine.testing import reference
from engine.testing.cuda_graphs import replayed_tokens


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny"))
    reference.tiny_checkpoint(folder, "LlamaForCausalLM", dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    return folder


def test_greedy_tokens_match_the_torch_backend(tiny_model):
    prompts = reference.random_prompts(256, [5, 33, 3], seed=3)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_model, dtype="float32", attention_backend=backend, block_size=16, max_model_len=128,
                  max_num_batched_tokens=16)
        assert llm.engine.runner.attention.name == backend
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]


def test_decode_replayed_over_static_buffers_gives_the_eager_tokens(tiny_model):
    """What ``cuda_graph_support = "decode-only"`` promises, checked without a GPU
    (``engine.testing.cuda_graphs``): decode steps padded into buckets of static buffers
    overwritten in place, attended through the metadata built once at capture, give the tokens
    eager steps give (requests finishing at different steps: batches of 3, 2 and 1 meet buckets
    of 4, 2 and 1)."""
    prompts = reference.random_prompts(256, [5, 33, 3], seed=4)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 5, 7)]
    options = dict(dtype="float32", attention_backend="triton", block_size=16, max_model_len=128)
    eager = [o.outputs[0].token_ids for o in LLM(tiny_model, **options).generate(prompts, params)]
    replayed, replays = replayed_tokens(LLM(tiny_model, **options), prompts, params, (1, 2, 4))
    assert replayed == eager
    assert all(replays[size] for size in (1, 2, 4)), replays
