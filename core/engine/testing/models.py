"""Model contract: for every architecture a model plugin claims (``example_configs``), a tiny
random ``transformers`` model is saved as a safetensors folder, loaded by the engine, and
compared: log-probabilities at every prompt position, and greedy tokens, in float32. The engine
runs with 8-token blocks and 24-token prefill chunks; config fields an example config leaves
at their default, which a model could hard-code unnoticed, are set to values no family
defaults to (:data:`UNUSUAL_CONFIG`); a model class with sliding-window layers
sets ``long_prompt_lengths`` (prompts longer than its example configs' window) so that prompts
outgrow the window and chunks cross its edge.
:class:`EmbeddingModelContract` is the same for a model that only pools (an encoder): its
embeddings for each pooling type, normalised or not; :class:`ClassifierModelContract` for a
sequence classifier (a cross-encoder): its label probabilities on single texts and pairs."""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine.interfaces import FALLBACK_ARCHITECTURE
from engine.plugins import Registration
from engine.testing import reference

# Values no family defaults to, for config fields a model reads and could instead hard-code (Llama's
# rope base 10000, its eps 1e-6): set where an example config leaves the field unset, so the
# checkpoint's value differs from any default. rms_norm_eps 1e-3 is ~2 % of the tiny models'
# embedding mean square, which moves log-probs by far more than the kit's tolerance.
UNUSUAL_CONFIG = {"rope_theta": 5000.0, "rms_norm_eps": 1e-3}


def with_unusual_values(config_kwargs: dict) -> dict:
    """``config_kwargs`` (an example config) with :data:`UNUSUAL_CONFIG`'s value for each field
    the config has and the example leaves unset; ``rope_theta`` only where the config has one
    rope base (not one per layer type, as Gemma 3's ``rope_parameters``)."""
    from transformers import AutoConfig

    kwargs = dict(config_kwargs)
    fields = {k: v for k, v in kwargs.items() if k != "model_type"}
    default = AutoConfig.for_model(kwargs["model_type"], **fields)
    rope = getattr(default, "rope_parameters", None)
    if "rope_theta" not in kwargs and "rope_parameters" not in kwargs and "rope_theta" in (rope or {}):
        kwargs["rope_theta"] = UNUSUAL_CONFIG["rope_theta"]
    if "rms_norm_eps" not in kwargs and hasattr(default, "rms_norm_eps"):
        kwargs["rms_norm_eps"] = UNUSUAL_CONFIG["rms_norm_eps"]
    return kwargs


class _Checkpoints:
    """What both contracts build first: the plugin's model class and, per example config, a
    tiny random ``transformers`` model saved as a safetensors folder."""

    model_class: str  # "package.module:Class"
    # the engine's allow-list (None: every installed plugin): to check a model class another plugin's
    # registration of its architecture shadows, leave that plugin out
    plugins: tuple[str, ...] | None = None
    auto_class = "AutoModelForCausalLM"  # the transformers class the checkpoints are built with
    random_norms = True  # norm weights drawn at random (all-ones would hide a dropped or swapped norm)
    # the example configs to check, by key (None: every one): e.g. the main config in a fast
    # class and the variants in a slow one
    config_keys: tuple[str, ...] | None = None
    # more parameters or buffers drawn at random, by name suffix (with random_norms): those
    # transformers initialises to a constant that would hide their misuse, e.g. a router's bias
    random_parameters: tuple[str, ...] = ()

    @pytest.fixture(scope="class")
    @classmethod
    def model_cls(cls):
        model_cls = Registration("models", "", cls.model_class, "").load()
        if model_cls.multimodal_processor is not None:
            pytest.skip(
                "a multimodal model: its checkpoint needs its family's processor, so its own tests "
                "run engine.testing.multimodal.MultiModalContract"
            )
        return model_cls

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoints(cls, model_cls, tmp_path_factory):
        """(folder, transformers model) per example config (those of ``config_keys``)."""
        configs = model_cls.example_configs()
        keys = list(configs) if cls.config_keys is None else list(cls.config_keys)
        unknown = set(keys) - set(configs)
        assert not unknown, f"config_keys {sorted(unknown)} are not example configs of {model_cls.__name__}"
        out = {}
        for key in keys:
            kwargs = configs[key]
            folder = str(tmp_path_factory.mktemp(key.replace("/", "_")))
            kwargs = with_unusual_values(kwargs)
            architecture = key.split("-")[0]
            model = reference.tiny_checkpoint(folder, architecture, kwargs, auto_class=cls.auto_class)
            if cls.random_norms:
                reference.randomize_norms(model, folder, also=cls.random_parameters)
            _claim(folder, architecture)
            out[key] = (folder, model)
        return out

    def _assert_serves_model_class(self, llm) -> None:
        """The engine serves the checkpoints with the class under test (or the base a subclass
        that only picks example configs stands for), not another plugin's registration of the
        architecture: leave that plugin out with ``plugins``."""
        served = type(llm.engine.model)
        wanted = Registration("models", "", self.model_class, "").load()
        assert _stands_for(wanted, served), (
            f"the engine served {served.__module__}.{served.__qualname__}, not {self.model_class}"
        )


# what a subclass that only picks other example configs of a model class defines
_CONFIGS_ONLY = {
    "__module__",
    "__qualname__",
    "__doc__",
    "__firstlineno__",
    "__static_attributes__",
    "__abstractmethods__",
    "_abc_impl",
    "example_configs",
}


def _stands_for(model_cls: type, served: type) -> bool:
    """Whether ``served`` is ``model_cls`` or a base of it that differs in example configs only."""
    for cls in model_cls.__mro__:
        if cls is served:
            return True
        if set(vars(cls)) - _CONFIGS_ONLY:
            return False
    return False


def _claim(folder: str, architecture: str) -> None:
    """Write ``architecture`` as the checkpoint's, which selects the model class: transformers'
    ``save_pretrained`` writes its own class's name (LlamaForCausalLM for any llama-type model)."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["architectures"] = [architecture]
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


class ModelContract(_Checkpoints):
    """Checks, for every example config (each must have at least two hidden layers, so every
    step's attention metadata serves several layers and a backend that memoizes per-step
    work across layers cannot pass by luck; its norm weights are drawn at random, so a model
    that drops or swaps a norm differs):

    - log-probs at every prompt position and greedy tokens against ``transformers``;
    - greedy tokens of mixed-length prompts under continuous batching, chunked prefill and a
      KV pool small enough to preempt (it must preempt);
    - greedy tokens of prompts that share prefixes with prefix caching on (it must hit; a model
      with state layers, Mamba2, runs with it off and must not).

    A model of state layers only never preempts (a request's one slot is all it ever needs).

    ``attention_backend`` and ``platform`` (registered names; None: the engine's choice) run
    it all under a chosen backend and platform, e.g. a subclass per backend a model must
    work with. A fallback model class (registered as ``FALLBACK_ARCHITECTURE``) gives example
    configs of any architectures it should run."""

    attention_backend: str | None = None
    platform: str | None = None
    model_impl = "auto"  # vLLM's --model-impl ("transformers": the fallback, even where a plugin claims it)
    logprob_atol = 2e-4
    new_tokens = 12
    long_prompt_lengths: tuple[int, ...] = ()  # extra prompts, e.g. longer than a sliding window

    def _llm(self, folder: str, **options):
        """The engine on ``folder`` in float32, under the chosen backend and platform."""
        from engine import LLM

        llm = LLM(
            folder,
            dtype="float32",
            attention_backend=self.attention_backend,
            device=self.platform,
            plugins=self.plugins,
            model_impl=self.model_impl,
            **options,
        )
        self._assert_serves_model_class(llm)
        if self.platform is not None:
            assert llm.engine.platform.name == self.platform
        if self.attention_backend is not None:
            assert llm.engine.attention.name == self.attention_backend
        return llm

    def test_declares_example_configs(self, model_cls):
        from transformers import AutoConfig

        configs = model_cls.example_configs()
        assert configs, "a model plugin must give the kit at least one tiny config"
        claimed = {key.split("-")[0] for key in configs}
        claims = set(model_cls.architectures)
        if FALLBACK_ARCHITECTURE not in claims:  # a fallback's examples may be of any architecture
            assert claimed <= claims, claimed - claims
            assert claims <= claimed, "every claimed architecture needs an example config"
        for key, kwargs in configs.items():
            kwargs = dict(kwargs)
            layers = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs).num_hidden_layers
            assert layers >= 2, f"{key}: give it num_hidden_layers >= 2, so layers share a step's metadata"

    def test_logprobs_and_greedy_match_transformers(self, checkpoints):
        from engine import SamplingParams

        for key, (folder, hf_model) in checkpoints.items():
            llm = self._llm(folder, num_blocks=64, block_size=8, max_num_batched_tokens=24)
            prompts = reference.random_prompts(
                hf_model.config.vocab_size, [5, 17, 30, 9, *self.long_prompt_lengths], seed=1
            )
            outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=-1, temperature=0))
            for ids, out in zip(prompts, outs):
                expected = reference.hf_logprobs(hf_model, ids)
                assert out.prompt_logprobs[0] is None
                for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
                    got = torch.tensor([entry[t].logprob for t in range(len(entry))])
                    torch.testing.assert_close(
                        got,
                        expected[pos - 1],
                        atol=self.logprob_atol,
                        rtol=0,
                        msg=lambda m, key=key, pos=pos: f"{key} position {pos}: {m}",
                    )
            greedy = llm.generate(
                prompts, SamplingParams(max_tokens=self.new_tokens, temperature=0, ignore_eos=True)
            )
            expected_tokens = reference.hf_greedy(hf_model, prompts, self.new_tokens)
            assert [o.outputs[0].token_ids for o in greedy] == expected_tokens, key

    def test_greedy_under_preemption_matches_transformers(self, checkpoints):
        """Ten mixed-length prompts, at most six running, 24-token steps and a pool of 12
        8-token blocks, fewer than six running prompts need even when every layer keeps only
        a short window: requests are preempted, recomputed and resumed."""
        for key, (folder, hf_model) in checkpoints.items():
            llm = self._llm(
                folder,
                num_blocks=12,
                block_size=8,
                max_num_batched_tokens=24,
                max_num_seqs=6,
                max_model_len=64,
                enable_prefix_caching=False,
            )
            prompts = reference.random_prompts(
                hf_model.config.vocab_size, [3, 41, 17, 8, 33, 25, 5, 12, 29, 19], seed=2
            )
            assert self._greedy(llm, prompts) == reference.hf_greedy(hf_model, prompts, self.new_tokens), key
            if all(group.state for group in llm.engine.kv_groups):
                continue  # state layers only (Mamba2): a running request never needs more, none is preempted
            assert llm.engine.stats()["preemptions"] > 0, f"{key}: the pool must be small enough to preempt"

    def test_greedy_with_prefix_caching_matches_transformers(self, checkpoints):
        """Prompts that share a 19-token prefix (two full 8-token blocks, cached) or all of
        another prompt, sent after the prompt they share it with has run."""
        for key, (folder, hf_model) in checkpoints.items():
            llm = self._llm(
                folder, num_blocks=64, block_size=8, max_num_batched_tokens=24, enable_prefix_caching=True
            )
            vocab = hf_model.config.vocab_size
            shared = reference.random_prompts(vocab, [19], seed=3)[0]
            tails = reference.random_prompts(vocab, [1, 6, 13, 4], seed=4)
            first = [shared + tails[0]]
            later = [shared + tail for tail in tails[1:]] + [list(shared), shared + tails[0] + tails[1]]
            got = self._greedy(llm, first) + self._greedy(llm, later)
            assert got == reference.hf_greedy(hf_model, first + later, self.new_tokens), key
            if any(group.state for group in llm.engine.kv_groups):  # Mamba layers: caching is off, said so
                assert not llm.engine.config.cache.enable_prefix_caching, key
                assert llm.engine.stats()["prefix_hits"] == 0, key
                continue
            assert llm.engine.stats()["prefix_hits"] > 0, f"{key}: the shared prefix must come from the cache"

    def _greedy(self, llm, prompts) -> list[list[int]]:
        from engine import SamplingParams

        outs = llm.generate(
            prompts, SamplingParams(max_tokens=self.new_tokens, temperature=0, ignore_eos=True)
        )
        return [o.outputs[0].token_ids for o in outs]


class EmbeddingModelContract(_Checkpoints):
    """For a model without an LM head (``generative = False``): ``LLM.embed`` under each
    pooling type (``override_pooler_config``), with and without normalisation, against the
    ``transformers`` model's pooled last hidden state (cosine and values, float32) on mixed
    prompt lengths, and the KV blocks all free afterwards."""

    auto_class = "AutoModel"  # built without an LM head
    random_norms = False
    atol = 1e-4
    min_cosine = 0.9999

    def test_declares_an_encoder(self, model_cls):
        configs = model_cls.example_configs()
        assert configs, "a model plugin must give the kit at least one tiny config"
        assert {key.split("-")[0] for key in configs} == set(model_cls.architectures)
        assert not model_cls.generative, "EmbeddingModelContract is for models without an LM head"

    @pytest.mark.parametrize("pooling_type", ["CLS", "MEAN", "LAST"])
    def test_embeddings_match_transformers(self, checkpoints, pooling_type):
        from engine import LLM, PoolingParams

        for folder, hf_model in checkpoints.values():
            llm = LLM(
                folder,
                dtype="float32",
                num_blocks=64,
                block_size=8,
                plugins=self.plugins,
                override_pooler_config={"pooling_type": pooling_type, "normalize": False},
            )
            self._assert_serves_model_class(llm)
            prompts = reference.random_prompts(hf_model.config.vocab_size, [5, 17, 30, 1, 9], seed=1)
            for normalize in (False, True):
                outs = llm.embed(prompts, PoolingParams(normalize=normalize))
                for ids, out in zip(prompts, outs):
                    reference.assert_pooled_matches(
                        out.outputs.embedding,
                        hf_model,
                        ids,
                        pooling_type,
                        normalize,
                        self.atol,
                        self.min_cosine,
                    )
            assert llm.engine.kv_cache_manager.usage == 0, "a finished pooling request keeps no KV blocks"


class ClassifierModelContract(_Checkpoints):
    """For a sequence classifier (a cross-encoder: ``num_labels`` set, :meth:`Model.classify`):
    ``LLM.classify`` on single texts and on pairs laid out as a BERT tokenizer lays them out
    (``[CLS] A [SEP]``, ``[CLS] A [SEP] B [SEP]``, with its token types where the config has
    more than one), against the ``transformers`` model's logits under the same activation
    (sigmoid for one label, else softmax), float32."""

    auto_class = "AutoModelForSequenceClassification"
    random_norms = False
    atol = 1e-5
    cls_id, sep_id = 2, 3  # marker tokens; the texts' tokens are drawn above them

    def test_declares_a_classifier(self, model_cls):
        configs = model_cls.example_configs()
        assert {key.split("-")[0] for key in configs} == set(model_cls.architectures)
        assert not model_cls.generative, "ClassifierModelContract is for models without an LM head"

    def test_probs_match_transformers(self, checkpoints):
        from engine import LLM
        from engine.runner.pooling import label_probs

        for folder, hf_model in checkpoints.values():
            # the plain cpu platform: exact float32 kernels, for parity
            llm = LLM(
                folder, dtype="float32", device="cpu", num_blocks=64, block_size=8, plugins=self.plugins
            )
            self._assert_serves_model_class(llm)
            prompts, types = self._prompts(hf_model.config)
            outs = llm.classify(prompts)
            for ids, token_types, out in zip(prompts, types, outs):
                segments = (
                    {"token_type_ids": torch.tensor([token_types])} if self._paired(hf_model.config) else {}
                )
                with torch.no_grad():
                    logits = hf_model(input_ids=torch.tensor([ids]), **segments).logits
                expected = label_probs(logits.float())[0]
                assert out.outputs.num_classes == hf_model.config.num_labels
                torch.testing.assert_close(
                    torch.tensor(out.outputs.probs), expected, atol=self.atol, rtol=1e-4
                )
            assert llm.engine.kv_cache_manager.usage == 0, "a finished pooling request keeps no KV blocks"

    def _prompts(self, config) -> tuple[list[list[int]], list[list[int]]]:
        """Single texts and pairs, with the token types a BERT tokenizer gives them."""
        gen = torch.Generator().manual_seed(3)
        texts = [
            torch.randint(4, config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 1, 30, 9, 12)
        ]
        prompts, types = [], []
        for first, second in [(texts[0], None), (texts[1], texts[2]), (texts[3], texts[4]), (texts[5], None)]:
            ids = [self.cls_id, *first, self.sep_id]
            segment_b = [*second, self.sep_id] if second else []
            prompts.append(ids + segment_b)
            paired = self._paired(config)
            types.append([0] * len(ids) + [1 if paired else 0] * len(segment_b))
        return prompts, types

    def _paired(self, config) -> bool:
        """Whether the model tells a pair's segments apart by token type (BERT's)."""
        return getattr(config, "type_vocab_size", 1) > 1


def tensor_parallel_greedy_matches_transformers(model_cls, architecture: str, folder: str) -> None:
    """``model_cls``'s example config for ``architecture`` on two ``mp`` ranks gives
    ``transformers``' greedy tokens (a tiny random checkpoint saved to ``folder``)."""
    from engine import LLM, SamplingParams

    kwargs = model_cls.example_configs()[architecture]
    hf_model = reference.tiny_checkpoint(folder, architecture, kwargs)
    prompts = reference.random_prompts(kwargs["vocab_size"], [5, 19, 2, 33], seed=7)
    llm = LLM(
        folder,
        dtype="float32",
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        num_blocks=40,
        block_size=8,
        max_model_len=64,
    )
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == reference.hf_greedy(hf_model, prompts, 12)


def expert_bytes_per_rank(model_cls, architecture: str, size: int = 2) -> tuple[int, list[int]]:
    """The bytes of ``model_cls``'s stacked experts (its :class:`engine.layers.FusedMoE` layers)
    for its example config ``architecture`` in float32: built on one rank, and on each of
    ``size`` tensor-parallel ranks (built, not loaded: building needs no communicator)."""
    import transformers

    from engine.distributed import TensorParallel, tensor_parallel
    from engine.interfaces import ModelContext, QuantContext
    from engine.layers import FusedMoE, UnquantizedLinearMethod

    kwargs = dict(model_cls.example_configs()[architecture])
    hf_config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    method = UnquantizedLinearMethod(QuantContext(None, torch.float32, None))
    ctx = ModelContext(hf_config, torch.float32, torch.device("cpu"), method)

    def expert_bytes(group: TensorParallel) -> int:
        with tensor_parallel(group):
            model = model_cls(ctx)
        experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
        return sum(p.numel() * p.element_size() for m in experts for p in m.parameters())

    return expert_bytes(TensorParallel()), [expert_bytes(TensorParallel(rank, size)) for rank in range(size)]
