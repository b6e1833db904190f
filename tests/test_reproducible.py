"""Reproducible greedy output in the default mode: the same temperature-0 request gives the same
tokens and log-probs, bit for bit, whether its prompt is prefilled cold, from the prefix cache,
split across chunked-prefill chunks, or batched beside other requests (issue 32: repeats served
from the cache used to answer differently). On the default model, in the default configuration,
where its GEMMs compute each row alone: on a CPU with AMX cpu-native runs steps of more than 16
rows on a bf16 copy of the weights whose rounding depends on the step's rows, as a bf16 model's
GEMMs do (what the default mode does not promise; ``--batch-invariant`` does), so there the copy
is turned off here."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine_platforms_cpu_native import kernels

PROMPT = (
    "You are a careful assistant. Answer in full sentences. Name three colors of the rainbow, "
    "then explain in a few words why the sky looks blue on a clear afternoon."
)
OTHERS = ["Tell me a short story about a cat.", "What is the capital of France?", "1 2 3 4 5 6 7 8"]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)


def _answer(llm: LLM, prompts: list[str], index: int = 0):
    """(token ids, chosen-token log-probs) of ``prompts[index]`` generated beside the rest."""
    out = llm.generate(prompts, PARAMS)[index].outputs[0]
    return out.token_ids, [next(iter(step.values())).logprob for step in out.logprobs]


@pytest.fixture(scope="module", autouse=True)
def no_amx_tiles():
    """The default model's rows are the same in any batch on the int8 kernel; on AMX, steps of
    more than 16 rows (a cold prompt) would go to tiles, whose bits are another kernel's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(kernels.TILES_VARIABLE, "0")
        yield


@pytest.fixture(scope="module")
def default_llm(default_tokenizer, no_amx_tiles):
    return LLM()


def test_the_same_request_five_ways_gives_the_same_answer(default_llm):
    cold = _answer(default_llm, [PROMPT])
    warm = _answer(default_llm, [PROMPT])  # the prompt's whole blocks from the prefix cache
    batched = _answer(default_llm, [OTHERS[0], PROMPT, *OTHERS[1:]], index=1)
    # 5-token steps: the prompt prefilled in chunks that are not tiles, cold
    chunked = _answer(LLM(max_num_batched_tokens=5, enable_prefix_caching=False), [PROMPT])
    again = _answer(default_llm, [PROMPT])
    assert len(cold[0]) == PARAMS.max_tokens
    for name, answer in {"warm": warm, "batched": batched, "chunked": chunked, "again": again}.items():
        assert answer == cold, f"{name}: tokens or log-probs differ from the cold run's"


def test_the_engine_says_greedy_output_is_reproducible(default_llm):
    assert default_llm.engine.determinism() == "chunk-invariant"
