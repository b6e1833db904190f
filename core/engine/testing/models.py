"""Model contract: for every architecture a model plugin claims (``example_configs``), a tiny
random ``transformers`` model is saved as a safetensors folder, loaded by the engine, and
compared: log-probabilities at every prompt position, and greedy tokens, in float32. The engine
runs with 8-token blocks and 24-token prefill chunks; a model class with sliding-window layers
sets ``long_prompt_lengths`` (prompts longer than its example configs' window) so that prompts
outgrow the window and chunks cross its edge."""

from __future__ import annotations

import pytest
import torch

from engine.plugins import Registration
from engine.testing import reference


class ModelContract:
    model_class: str  # "package.module:Class"
    logprob_atol = 2e-4
    new_tokens = 12
    long_prompt_lengths: tuple[int, ...] = ()  # extra prompts, e.g. longer than a sliding window

    @pytest.fixture(scope="class")
    def cls(self):
        return Registration("models", "", self.model_class, "").load()

    @pytest.fixture(scope="class")
    def checkpoints(self, cls, tmp_path_factory):
        out = {}
        for key, kwargs in cls.example_configs().items():
            folder = str(tmp_path_factory.mktemp(key.replace("/", "_")))
            model = reference.tiny_checkpoint(folder, key.split("-")[0], kwargs)
            out[key] = (folder, model)
        return out

    def test_declares_example_configs(self, cls):
        configs = cls.example_configs()
        assert configs, "a model plugin must give the kit at least one tiny config"
        claimed = {key.split("-")[0] for key in configs}
        assert claimed <= set(cls.architectures), claimed - set(cls.architectures)
        assert set(cls.architectures) <= claimed, "every claimed architecture needs an example config"

    def test_logprobs_and_greedy_match_transformers(self, checkpoints):
        from engine import LLM, SamplingParams

        for key, (folder, hf_model) in checkpoints.items():
            llm = LLM(folder, dtype="float32", num_blocks=64, block_size=8, max_num_batched_tokens=24)
            prompts = reference.random_prompts(hf_model.config.vocab_size,
                                               [5, 17, 30, 9, *self.long_prompt_lengths], seed=1)
            outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=-1, temperature=0))
            for ids, out in zip(prompts, outs):
                expected = reference.hf_logprobs(hf_model, ids)
                assert out.prompt_logprobs[0] is None
                for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
                    got = torch.tensor([entry[t].logprob for t in range(len(entry))])
                    torch.testing.assert_close(got, expected[pos - 1], atol=self.logprob_atol, rtol=0,
                                               msg=lambda m, key=key, pos=pos: f"{key} position {pos}: {m}")
            greedy = llm.generate(prompts, SamplingParams(max_tokens=self.new_tokens, temperature=0,
                                                          ignore_eos=True))
            expected_tokens = reference.hf_greedy(hf_model, prompts, self.new_tokens)
            assert [o.outputs[0].token_ids for o in greedy] == expected_tokens, key
