"""A tiny random Llama through ``LLM(..., attention_backend="triton")`` on the CPU under
Triton's interpreter gives the torch backend's greedy tokens in float32 (whole prompts and
chunks of 16 — later chunks beside decode rows — then decode rows), and the same tokens when
its decode steps are replayed over the static buffers of the CUDA graph runner. Not collected
by itself (``TRITON_INTERPRET=1`` must be set first): ``test_conformance.py`` runs it in a
child process."""

import pytest

from engine import LLM, SamplingParams
from engine.testing import reference
from engine.testing.step_graphs import replayed_tokens

PROMPTS = reference.random_prompts(256, [5, 33, 3], seed=4)
# requests finishing at different steps: decode batches of 3, 2 and 1
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 8, 10)]


def _llm(folder, backend: str) -> LLM:
    llm = LLM(
        folder,
        dtype="float32",
        attention_backend=backend,
        block_size=16,
        max_model_len=128,
        max_num_batched_tokens=16,
    )
    assert llm.engine.runner.attention.name == backend
    return llm


@pytest.fixture(scope="module")
def triton_tokens(tiny_model):
    return [o.outputs[0].token_ids for o in _llm(tiny_model, "triton").generate(PROMPTS, PARAMS)]


def test_greedy_tokens_match_the_torch_backend(tiny_model, triton_tokens):
    assert triton_tokens == [
        o.outputs[0].token_ids for o in _llm(tiny_model, "torch").generate(PROMPTS, PARAMS)
    ]


def test_decode_replayed_over_static_buffers_gives_the_eager_tokens(tiny_model, triton_tokens):
    """What ``cuda_graph_support = "decode-only"`` promises, checked without a GPU
    (``engine.testing.step_graphs``): decode steps padded into buckets of static buffers
    overwritten in place, attended through the metadata built once at capture, give the eager
    tokens (batches of 3, 2 and 1 meet buckets of 4, 2 and 1)."""
    replayed, replays = replayed_tokens(_llm(tiny_model, "triton"), PROMPTS, PARAMS, (1, 2, 4))
    assert replayed == triton_tokens
    assert all(replays[size] for size in (1, 2, 4)), replays
