"""Model contract: for every architecture a model plugin claims (``example_configs``), a tiny
random ``transformers`` model is saved as a safetensors folder, loaded by the engine, and
compared: log-probabilities at every prompt position, and greedy tokens, in float32. The engine
runs with 8-token blocks and 24-token prefill chunks; a model class with sliding-window layers
sets ``long_prompt_lengths`` (prompts longer than its example configs' window) so that prompts
outgrow the window and chunks cross its edge.
:class:`EmbeddingModelContract` is the same for a model that only pools (an encoder): its
embeddings for each pooling type, normalised or not."""

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


class EmbeddingModelContract:
    """For a model without an LM head (``generative = False``): ``LLM.embed`` under each
    pooling type (``override_pooler_config``), with and without normalisation, against the
    ``transformers`` model's pooled last hidden state (cosine and values, float32) on mixed
    prompt lengths, and the KV blocks all free afterwards."""

    model_class: str  # "package.module:Class"
    atol = 1e-4
    min_cosine = 0.9999

    @pytest.fixture(scope="class")
    @classmethod
    def model_cls(cls):
        return Registration("models", "", cls.model_class, "").load()

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoints(cls, model_cls, tmp_path_factory):
        """(folder, transformers model) per example config, built without an LM head."""
        configs = model_cls.example_configs()
        folders = {key: str(tmp_path_factory.mktemp(key.replace("/", "_"))) for key in configs}
        return {key: (folders[key], reference.tiny_checkpoint(folders[key], key.split("-")[0], kwargs,
                                                              auto_class="AutoModel"))
                for key, kwargs in configs.items()}

    def test_declares_an_encoder(self, model_cls):
        configs = model_cls.example_configs()
        assert configs, "a model plugin must give the kit at least one tiny config"
        assert {key.split("-")[0] for key in configs} == set(model_cls.architectures)
        assert not model_cls.generative, "EmbeddingModelContract is for models without an LM head"

    @pytest.mark.parametrize("pooling_type", ["CLS", "MEAN", "LAST"])
    def test_embeddings_match_transformers(self, checkpoints, pooling_type):
        from engine import LLM, PoolingParams

        for folder, hf_model in checkpoints.values():
            llm = LLM(folder, dtype="float32", num_blocks=64, block_size=8,
                      override_pooler_config={"pooling_type": pooling_type, "normalize": False})
            prompts = reference.random_prompts(hf_model.config.vocab_size, [5, 17, 30, 1, 9], seed=1)
            for normalize in (False, True):
                outs = llm.embed(prompts, PoolingParams(normalize=normalize))
                for ids, out in zip(prompts, outs):
                    reference.assert_pooled_matches(out.outputs.embedding, hf_model, ids, pooling_type, normalize,
                                                    self.atol, self.min_cosine)
            assert llm.engine.kv_cache_manager.usage == 0, "a finished pooling request keeps no KV blocks"
