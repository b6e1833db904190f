"""Quant-method contract: a plugin subclasses :class:`QuantMethodContract` once per format it
serves and states its tolerances; the kit checks, against plain math,

* dequantization of what a checkpoint stores equals the format's reference dequantizer,
  and stays within the stated quantization error of the original weight;
* ``apply`` equals dequantize-then-matmul, for one token, a few, and a batch, and adds the
  bias it is given (Qwen2's q/k/v have one);
* fused projections (q|k|v) loaded shard by shard, in any order (a checkpoint's is its
  files', not q, k, v);
* an online method's own rounding (``checkpoint_config`` None) keeps each row's precision on
  rows of very different magnitudes (a scale per row or group, not one per tensor) and is to
  nearest (truncating casts shrink nearly every weight toward zero);
* vocabulary tables (``embed``, LM-head ``apply``) when the method quantizes them;
* mixture-of-experts layers when it sets ``quantizes_experts``: experts loaded one (expert,
  shard) at a time dequantize (``dequantize_moe``) to the format's math and within the
  quantization error, and the layer's output (``apply_moe`` on rows sorted by expert) is the
  per-expert reference over the dequantized experts; otherwise experts stay unquantized;
* a tiny random Llama served through the method has log-probabilities within the stated
  tolerance of the same model unquantized (needs a model plugin serving LlamaForCausalLM);
* the cases the method cannot run are refused with a reason (``ValueError``).

A checkpoint format overrides ``checkpoint_tensors`` (how its files store one weight) and
``write_model`` (a tiny model in its format; :func:`write_quantized_checkpoint` does it for
safetensors formats); online methods keep the defaults.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from engine.interfaces.quant import QuantContext
from engine.testing import reference

TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    initializer_range=0.05,
)


LINEAR_WEIGHTS = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


def write_quantized_checkpoint(
    source: str, folder: str, quantize: Callable[[torch.Tensor], dict], quantization_config: dict
) -> None:
    """Copy the safetensors folder ``source`` to ``folder`` with every linear weight replaced
    by ``quantize(weight)`` — {parameter name: tensor}, e.g. {"weight": ..., "weight_scale": ...}
    — and ``quantization_config`` added to its config.json, as a real quantized checkpoint."""
    from safetensors.torch import load_file, save_file

    os.makedirs(folder, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(f for f in os.listdir(source) if f.endswith(".safetensors")):
        for key, value in load_file(os.path.join(source, name)).items():
            if key.endswith(LINEAR_WEIGHTS):
                prefix = key.removesuffix("weight")
                tensors |= {prefix + param: tensor for param, tensor in quantize(value).items()}
            else:
                tensors[key] = value
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    for name in os.listdir(source):
        if not name.endswith(".safetensors") and os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "How do I boil an egg?",
    "What is 12 times 7?",
    "Explain gravity to a child.",
    "Give me a synonym for happy.",
    "What is Python used for?",
    "Tell me a fun fact about cats.",
    "Translate 'good morning' to Spanish.",
    "Why is the sky blue?",
    "List two planets.",
]


PLAN_OPTIONS = dict(dtype="bfloat16", max_model_len=128, kv_cache_memory=8 * 2**20, block_size=16)


def assert_planned_as_loaded(model: str, **options) -> None:
    """The weights ``engine serve --dry-run`` plans for ``model`` are within 10% of the bytes
    the loaded engine then holds: a quant method's plan (``planned_kernel``) against the real
    thing. ``options``: engine options over :data:`PLAN_OPTIONS`."""
    from engine import LLM
    from engine.config import EngineConfig
    from engine.core import startup
    from engine.plugins import load_plugins

    options = {**PLAN_OPTIONS, **options}
    config = EngineConfig.from_kwargs(model=model, **options)
    planned = startup.plan(config, load_plugins(config.plugins)).memory["weights"]
    loaded = LLM(model, **options).engine.startup.memory["weights"]
    assert abs(planned - loaded) <= 0.1 * loaded, (planned, loaded)


def prompt_logprobs(llm, prompts: list[list[int]]) -> list[torch.Tensor]:
    """``llm``'s log-probabilities of every prompt token after the first, [len − 1, vocab] a
    prompt: what :func:`engine.testing.reference.hf_logprobs` gives ``transformers``' (less its last row)."""
    from engine import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=-1, temperature=0))
    return [
        torch.tensor([[entry[t].logprob for t in range(len(entry))] for entry in out.prompt_logprobs[1:]])
        for out in outs
    ]


def greedy_chats(llm, max_tokens: int = 32) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy continuation) for each of :data:`CHAT_QUESTIONS` as a user turn."""
    from engine import SamplingParams

    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return prompts, [o.outputs[0].token_ids for o in outs]


DEFAULT_MODEL_CHAT_OPTIONS = dict(quantization="unquantized", max_model_len=512, num_blocks=160)


def default_model_greedy_chats(dtype: str = "bfloat16") -> tuple[list[list[int]], list[list[int]]]:
    """:func:`greedy_chats` of the embedded default model dequantized to ``dtype``
    (:data:`DEFAULT_MODEL_CHAT_OPTIONS`): the reference several plugins' acceptance tests hold
    their quantized default model to. Computed once per process (an engine build and 12 x 32
    greedy tokens: tens of seconds in bf16 on a CPU without AVX-512); each call gets its own
    copy."""
    prompts, continuations = _default_model_greedy_chats(dtype)
    return [list(p) for p in prompts], [list(c) for c in continuations]


TokenRows = tuple[tuple[int, ...], ...]


@functools.cache
def _default_model_greedy_chats(dtype: str) -> tuple[TokenRows, TokenRows]:
    from engine import LLM

    prompts, continuations = greedy_chats(LLM(dtype=dtype, **DEFAULT_MODEL_CHAT_OPTIONS))
    return tuple(map(tuple, prompts)), tuple(map(tuple, continuations))


def teacher_forced_agreement(llm, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """The fraction of continuation tokens that are ``llm``'s own greedy choice given the same
    preceding tokens: quantization error counted token by token, without one early divergence
    turning every later position into a mismatch."""
    from engine import SamplingParams

    outs = llm.generate(
        [p + c for p, c in zip(prompts, continuations)],
        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1),
    )
    same = total = 0
    for prompt, continuation, out in zip(prompts, continuations, outs):
        for offset, token in enumerate(continuation):
            entry = out.prompt_logprobs[len(prompt) + offset]
            same += any(t == token and lp.rank == 1 for t, lp in entry.items())
            total += 1
    return same / total


def _fused_linear(input_size: int, output_sizes, bias: bool = False):
    """The layer class :meth:`QuantMethodContract._loaded` builds: a fused projection."""
    from engine.layers import Linear

    return lambda method, dtype: Linear(input_size, list(output_sizes), bias, method, dtype)


def _row_factors(rows: int) -> torch.Tensor:
    """Row magnitudes 1, 1/4, 1/16, 1, ... (powers of two: exact in every scale format)."""
    return 0.25 ** (torch.arange(rows) % 3).float()


class QuantMethodContract:
    method: str  # the registered quant-method name
    checkpoint_config: dict | None = None  # what a checkpoint declares; None: online quantization
    dtype = torch.bfloat16  # activation dtype of the layer checks
    quant_error: float  # max |dequantize − W| / max |W|
    reference_atol = 1e-2  # max |dequantize − plain math| / max |W| (scale rounding to dtype)
    apply_rtol = 2e-2  # max |apply − x·dequantize()ᵀ| / max |x·dequantize()ᵀ|
    logprob_atol: float  # mean |Δ log-prob| of a tiny model against the float32 model
    input_size = 256
    output_sizes = (96, 32, 32)

    def checkpoint_tensors(self, weight: torch.Tensor) -> tuple[list[tuple[str, object]], torch.Tensor]:
        """How a checkpoint of this format stores ``weight`` [out, in] for one Linear shard:
        the (parameter name, tensor) pairs to load, and the weight those pairs represent by the
        format's plain math. Online methods load the float weight itself."""
        return [("weight", weight.to(self.dtype))], weight

    def write_model(self, folder: str, hf_model, hf_folder: str) -> dict:
        """Write ``hf_model`` (saved as safetensors in ``hf_folder``) in this format under
        ``folder``; return the ``LLM`` keyword arguments that serve it through this method."""
        return {"model": hf_folder, "quantization": self.method}

    def refusals(self) -> list[Callable[[], object]]:
        """Calls that must raise ValueError with a reason (unsupported configs, platforms)."""
        return []

    # -- fixtures -------------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def registry(cls):
        from engine.plugins import load_plugins

        return load_plugins(None)

    @pytest.fixture(scope="class")
    @classmethod
    def platform(cls, registry):
        from engine.core.setup import select_platform

        return select_platform(registry, "cpu")

    def make_method(self, registry, platform):
        cls = registry.get("quant_methods", self.method)
        return cls(QuantContext(self.checkpoint_config, self.dtype, platform))

    def _loaded(self, layer_cls, registry, platform, sizes, seed=0, order=None, row_scales=None, **kwargs):
        """``layer_cls(method, dtype)`` with random shards of ``sizes`` rows loaded, in ``order``
        (default: shard by shard), each row times ``row_scales(rows)`` when given; a bias, if
        the layer has one, loaded too -> (layer, original weight, the weight its loaded
        tensors represent)."""
        method = self.make_method(registry, platform)
        gen = torch.Generator().manual_seed(seed)
        layer = layer_cls(method=method, dtype=self.dtype, **kwargs)
        originals = [torch.randn(rows, self.input_size, generator=gen) * 0.05 for rows in sizes]
        if row_scales is not None:
            originals = [weight * row_scales(len(weight))[:, None] for weight in originals]
        references = [None] * len(sizes)
        for shard in range(len(sizes)) if order is None else order:
            weight = originals[shard]
            if layer.method is method:
                tensors, represented = self.checkpoint_tensors(weight)
            else:  # a vocabulary table the method leaves unquantized
                tensors, represented = [("weight", weight.to(self.dtype))], weight
            for name, tensor in tensors:
                layer.load_shard(name, tensor, shard)
            if getattr(layer, "bias", None) is not None:
                layer.load_shard("bias", torch.randn(len(weight), generator=gen).to(self.dtype), shard)
            references[shard] = represented.float()
        layer.process_weights_after_loading()
        return layer, torch.cat(originals), torch.cat(references)

    @pytest.fixture(scope="class")
    @classmethod
    def linear(cls, registry, platform):
        """Built once per class, by an instance of its own (a format's overrides are methods)."""
        return cls()._loaded(
            _fused_linear(cls.input_size, cls.output_sizes), registry, platform, cls.output_sizes
        )

    # -- layer checks ---------------------------------------------------------------------------

    def test_dequantize_matches_plain_math(self, linear):
        layer, _, represented = linear
        got = layer.method.dequantize(layer).float()
        assert got.shape == represented.shape
        err = (got - represented).abs().max() / represented.abs().max()
        assert err <= self.reference_atol, f"dequantize differs from the format's math by {err:.2e}"

    def test_quantization_error_is_bounded(self, linear):
        layer, original, _ = linear
        err = (layer.method.dequantize(layer).float() - original).abs().max() / original.abs().max()
        assert err <= self.quant_error, f"quantization error {err:.3e} > {self.quant_error}"

    @pytest.mark.parametrize("tokens", [1, 5, 64])
    def test_apply_matches_dequantize_then_matmul(self, linear, tokens):
        layer, _, _ = linear
        x = torch.randn(tokens, self.input_size, generator=torch.Generator().manual_seed(tokens)).to(
            self.dtype
        )
        got = layer(x)
        assert got.shape == (tokens, sum(self.output_sizes)) and got.dtype == self.dtype
        want = F.linear(x.float(), layer.method.dequantize(layer).float())
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err <= self.apply_rtol, f"apply differs from dequantize-then-matmul by {err:.2e}"

    def test_apply_adds_the_bias(self, registry, platform):
        """Llama's projections have no bias and Qwen2's q/k/v have one: ``apply`` must add the
        ``bias`` it is given, which a method written against Llama alone can drop."""
        linear = _fused_linear(self.input_size, self.output_sizes, bias=True)
        layer, _, _ = self._loaded(linear, registry, platform, self.output_sizes, seed=7)
        x = torch.randn(5, self.input_size, generator=torch.Generator().manual_seed(7)).to(self.dtype)
        want = F.linear(x.float(), layer.method.dequantize(layer).float(), layer.bias.float())
        err = (layer(x).float() - want).abs().max() / want.abs().max()
        assert err <= self.apply_rtol, (
            f"apply with a bias differs from dequantize-then-matmul + bias by {err:.2e}"
        )

    def test_fused_shards_load_in_any_order(self, registry, platform):
        """A checkpoint's tensors come in its files' order (k_proj sorts before q_proj): each
        shard must land at its own offset, whatever order the shards arrive in."""
        last_first = reversed(range(len(self.output_sizes)))
        linear = _fused_linear(self.input_size, self.output_sizes)
        layer, _, represented = self._loaded(linear, registry, platform, self.output_sizes, order=last_first)
        got = layer.method.dequantize(layer).float()
        assert got.shape == represented.shape
        err = (got - represented).abs().max() / represented.abs().max()
        assert err <= self.reference_atol, f"shards loaded last to first dequantize off by {err:.2e}"

    def test_small_rows_keep_their_precision(self, registry, platform):
        """Real weights have rows of very different magnitudes. An online method's scales must
        follow them (per row or group): one scale for the whole tensor rounds a row 16x
        smaller than the largest on a grid 16x too coarse for it. The error of each row,
        divided by the row's factor, stays within ``quant_error`` as on even rows."""
        if self.checkpoint_config is not None:
            pytest.skip("a checkpoint's scales are its format's (test_dequantize_matches_plain_math)")
        linear = _fused_linear(self.input_size, self.output_sizes)
        layer, original, _ = self._loaded(
            linear, registry, platform, self.output_sizes, seed=9, row_scales=_row_factors
        )
        factors = torch.cat([_row_factors(rows) for rows in self.output_sizes])[:, None]
        error = (layer.method.dequantize(layer).float() - original).abs() / factors
        err = error.max() / (original.abs() / factors).max()
        assert err <= self.quant_error, f"rows 16x smaller: quantization error {err:.3e} > {self.quant_error}"

    def test_rounding_is_to_nearest(self, linear):
        """A cast to an integer type truncates: nearly every weight shrinks toward zero, where
        rounding to nearest shrinks about half of them (two thirds at most when a bf16 scale
        rounds every row's step down by its largest error, 2^-8; truncation with every step
        rounded up still shrinks seven eighths). At most three quarters may shrink."""
        if self.checkpoint_config is not None:
            pytest.skip("a checkpoint's rounding is its writer's, not the method's")
        layer, original, _ = linear
        shrunk = (layer.method.dequantize(layer).float().abs() < original.abs()).float().mean()
        assert shrunk <= 0.75, f"{shrunk:.0%} of the weights shrink toward zero: truncated, not rounded"

    def test_vocabulary_tables(self, registry, platform):
        from engine.layers import VocabEmbedding

        method = self.make_method(registry, platform)
        table, _, _ = self._loaded(
            lambda method, dtype: VocabEmbedding(192, self.input_size, method, dtype),
            registry,
            platform,
            [192],
            seed=3,
        )
        assert (type(table.method) is type(method)) == type(method).quantizes_embeddings
        ids = torch.tensor([0, 5, 191, 5])
        dense = table.method.dequantize(table).float()
        torch.testing.assert_close(table(ids).float(), dense[ids], atol=1e-3, rtol=1e-2)
        hidden = torch.randn(3, self.input_size).to(self.dtype)
        want = F.linear(hidden.float(), dense)
        err = (table.logits(hidden).float() - want).abs().max() / want.abs().max()
        assert err <= self.apply_rtol

    @pytest.fixture(scope="class")
    @classmethod
    def moe(cls, registry, platform):
        """Built once per class, by an instance of its own (a format's overrides are methods)."""
        from engine.testing.moe import loaded_moe

        contract = cls()
        method = contract.make_method(registry, platform)
        quantized = type(method).quantizes_experts  # else experts load as float weights, as vocabulary tables
        layer, originals, represented = loaded_moe(
            method,
            4,
            2,
            cls.input_size,
            cls.input_size,
            True,
            contract.checkpoint_tensors if quantized else None,
            seed=5,
        )
        stored = [part.method for part in (layer.gate_up, layer.down)]
        assert all((type(m) is type(method)) == quantized for m in stored)
        return layer, originals, represented

    def test_moe_experts_dequantize_to_the_format(self, moe):
        layer, originals, represented = moe
        for part, original, plain in zip((layer.gate_up, layer.down), originals, represented):
            got = part.method.dequantize_moe(part).float()
            assert got.shape == plain.shape
            err = (got - plain).abs().max() / plain.abs().max()
            assert err <= self.reference_atol, f"dequantize_moe differs from the format's math by {err:.2e}"
            # the worst group over ~12x the linear check's weights: its error bound with 1.5x room
            err = (got - original).abs().max() / original.abs().max()
            assert err <= 1.5 * self.quant_error, (
                f"expert quantization error {err:.3e} > 1.5 x {self.quant_error}"
            )

    @pytest.mark.parametrize("tokens", [1, 7, 64])
    def test_moe_layer_matches_the_per_expert_reference(self, moe, tokens):
        from engine.testing.moe import reference_moe

        layer, _, _ = moe
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, self.input_size, generator=gen).to(self.dtype)
        logits = torch.randn(tokens, 4, generator=gen)
        got = layer(x, logits)
        assert got.shape == x.shape and got.dtype == self.dtype
        experts = (part.method.dequantize_moe(part) for part in (layer.gate_up, layer.down))
        want = reference_moe(x, logits, *experts, 2, True)
        err = (got.float() - want).abs().max() / want.abs().max()
        # two matmuls in a row (gate|up, then down on its rounded SwiGLU): twice one's tolerance
        assert err <= 2 * self.apply_rtol, f"MoE layer differs from the per-expert reference by {err:.2e}"

    def test_refusals_give_reasons(self):
        for call in self.refusals():
            with pytest.raises(ValueError, match=r"\w+"):
                result = call()
                if isinstance(result, list) and result:  # a reasons list counts as a refusal
                    raise ValueError("; ".join(result))

    # -- model check ----------------------------------------------------------------------------

    def test_tiny_model_logprobs_close_to_unquantized(self, tmp_path_factory):
        from engine import LLM

        hf_folder = str(tmp_path_factory.mktemp("hf"))
        hf_model = reference.tiny_checkpoint(hf_folder, "LlamaForCausalLM", TINY_LLAMA, seed=4)
        kwargs = self.write_model(str(tmp_path_factory.mktemp(self.method)), hf_model, hf_folder)
        prompts = reference.random_prompts(TINY_LLAMA["vocab_size"], [9, 23], seed=5)
        common = dict(num_blocks=40, block_size=8, max_model_len=128)
        llm = LLM(dtype=str(self.dtype).removeprefix("torch."), **common, **kwargs)
        for ids, got in zip(prompts, prompt_logprobs(llm, prompts)):
            want = reference.hf_logprobs(hf_model, ids)[:-1]
            err = (got - want).abs().mean()
            assert err <= self.logprob_atol, f"mean |Δ logprob| {err:.3e} > {self.logprob_atol}"
