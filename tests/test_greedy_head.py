"""A greedy step's tokens from the LM head itself (``Model.compute_greedy``): on cpu-native's
int8 head copy a GGUF table gives each row's first maximum without writing its logits. The
runner asks for it only where every row reads nothing else of its logits, and the tokens are
those the logits' argmax gives."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine import LLM, SamplingParams
from engine.layers.decoder import DecoderForCausalLM
from engine.messages.request import Request
from engine.runner import sampler
from engine.testing import reference
from engine.testing.quant import TINY_LLAMA
from engine_platforms_cpu_native.logits import int8_tiles
from engine_quant_gguf.writer import write_gguf

TINY = dict(TINY_LLAMA, vocab_size=1000)  # more columns than the head refines
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _rows(*params: SamplingParams, output: int = 0) -> sampler.SamplingRows:
    requests = [Request(str(i), [1, 2], p) for i, p in enumerate(params)]
    for request in requests:
        request.output_token_ids.extend([5] * output)
    return sampler.SamplingRows(requests, torch.device("cpu"))


def test_only_rows_that_read_nothing_but_the_maximum_take_the_argmax_alone():
    assert sampler.argmax_only(_rows(GREEDY, GREEDY))
    assert not sampler.argmax_only(_rows(GREEDY, SamplingParams(temperature=0.7)))
    for other in (
        dict(logprobs=0),
        dict(logit_bias={3: 1.0}),
        dict(allowed_token_ids=[3, 4]),
        dict(repetition_penalty=1.1),
        dict(presence_penalty=0.5),
        dict(min_tokens=4),
    ):
        assert not sampler.argmax_only(_rows(GREEDY, SamplingParams(temperature=0, **other))), other
    assert sampler.argmax_only(_rows(SamplingParams(temperature=0, min_tokens=4), output=4))


@pytest.mark.skipif(not int8_tiles(), reason="this CPU has no AMX int8 tiles (no greedy head here)")
def test_greedy_steps_take_the_heads_tokens_and_give_the_logits_argmax(tmp_path, monkeypatch):
    """24 greedy requests decode on the head's tokens; beside a request asking for logprobs the
    same requests decode on the logits (no step takes the head's tokens) to the same tokens."""
    model = reference.tiny_checkpoint(str(tmp_path / "hf"), "LlamaForCausalLM", TINY)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, model, None, T.Q4_0)
    heads_tokens = []
    compute_greedy = DecoderForCausalLM.compute_greedy

    def counted(self, hidden):
        tokens = compute_greedy(self, hidden)
        heads_tokens.append(tokens is not None)
        return tokens

    monkeypatch.setattr(DecoderForCausalLM, "compute_greedy", counted)
    llm = LLM(path, dtype="bfloat16", max_num_seqs=32, block_size=16, num_blocks=200, max_model_len=256)
    prompts = reference.random_prompts(TINY["vocab_size"], [5 + 3 * i for i in range(24)], seed=2)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert sum(heads_tokens) >= GREEDY.max_tokens - 1  # every decode step of the 24
    heads_tokens.clear()
    scored = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    beside = llm.generate([*prompts, prompts[0]], [GREEDY] * 24 + [scored])
    assert not any(heads_tokens)
    assert [o.outputs[0].token_ids for o in beside[:24]] == alone


def test_greedy_steps_on_the_tiles_replay_a_recording(tmp_path, monkeypatch):
    """Where batched steps take the tiles and the head its int8 copy (forced here: without AMX the
    native builds run the same kernels' plain C), a greedy step above 16 rows replays its bucket's
    greedy recording, the head's candidates and the settling of the rows they leave included,
    and gives the tokens the logits give."""
    from engine_platforms_cpu_native import affine, logits

    for module, name in ((affine, "amx_tiles"), (affine, "int8_tiles"), (logits, "int8_tiles")):
        monkeypatch.setattr(module, name, lambda: True)
    model = reference.tiny_checkpoint(str(tmp_path / "hf"), "LlamaForCausalLM", TINY)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, model, None, T.Q4_0)
    llm = LLM(path, dtype="bfloat16", max_num_seqs=32, block_size=16, num_blocks=200, max_model_len=256)
    assert any(getattr(m, "int8_table", None) is not None for m in llm.engine.model.modules())
    prompts = reference.random_prompts(TINY["vocab_size"], [5 + 3 * i for i in range(24)], seed=3)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    graphs = llm.engine.runner.graphs
    assert graphs.graphs[24].greedy is not None and not graphs.score_eagerly
    scored = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    beside = llm.generate([*prompts, prompts[0]], [GREEDY] * 24 + [scored])
    assert [o.outputs[0].token_ids for o in beside[:24]] == alone
