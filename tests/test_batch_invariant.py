"""Batch-invariant mode: a request's greedy tokens and log-probs are bit for bit the same
alone, inside a batch of many, under ngram speculation, from the prefix cache and prefilled in
chunks (prefix caching and chunked prefill stay on over chunk-invariant attention)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def _prompts(tokenizer, count: int) -> list[list[int]]:
    words = [
        "the",
        "cat",
        "sat",
        "on",
        "the",
        "mat",
        "and",
        "the",
        "dog",
        "sat",
        "on",
        "the",
        "log",
        "while",
        "the",
        "bird",
        "sang",
    ]
    return [
        tokenizer.encode(" ".join(words[(i + j) % len(words)] for j in range(8 + (i * 7) % 40)))
        for i in range(count)
    ]


def _runs(llm_factory, prompts, targets, max_tokens) -> dict[str, list]:
    """Per way of running, per target, (token ids, chosen-token logprobs): alone, batched,
    alone again (its prompt's blocks now in the prefix cache), under ngram speculation, and
    with steps of 24 tokens (prompts prefilled in chunks)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)

    def seen(outputs):
        return [
            (o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
            for o in outputs
        ]

    llm = llm_factory()
    alone = [seen(llm.generate([prompts[t]], params))[0] for t in targets]
    batched = seen(llm.generate(prompts, params))
    cached = [seen(llm.generate([prompts[t]], params))[0] for t in targets]
    spec = seen(llm_factory(speculative_config=NGRAM).generate(prompts, params))
    chunked = seen(llm_factory(max_num_batched_tokens=24).generate(prompts, params))
    return {
        "alone": alone,
        "batched": [batched[t] for t in targets],
        "cached": cached,
        "speculative": [spec[t] for t in targets],
        "chunked": [chunked[t] for t in targets],
    }


def _differing(runs: dict[str, list]) -> list[str]:
    """The ways of running whose answers are not bit for bit the alone run's."""
    return [way for way, answers in runs.items() if answers != runs["alone"]]


@pytest.fixture(scope="module")
def tiny_prompts(default_tokenizer):
    return _prompts(default_tokenizer, 40)


@pytest.mark.parametrize("widened", [False, True], ids=["platform-gemm", "widening-kernel"])
def test_tiny_model_is_batch_invariant_in_bf16(tiny_llama, tiny_prompts, monkeypatch, widened):
    """With prefix caching and chunked prefill on (cpu-native attention is chunk-invariant); on
    the GEMM this CPU's platform picks (probed row buckets where it is oneDNN's), and on
    cpu-native's widening kernel (what a CPU without native bfloat16 gets), which declares
    ``invariant_rows``: then unpadded, and every decode bucket taped."""
    from engine_platforms_cpu_native import dense
    from engine_platforms_cpu_native.ops import NativeLayerOps

    if widened:
        monkeypatch.setattr(NativeLayerOps, "pack_dense", lambda self, w: dense.WidenedBf16(w, self.dtype))
    targets = [0, 13, 27, 39]

    def factory(**options):
        return LLM(tiny_llama[0], dtype="bfloat16", num_blocks=512, batch_invariant=True, **options)

    runs = _runs(factory, tiny_prompts, targets, 24)
    llm = factory()
    assert llm.engine.config.cache.enable_prefix_caching
    assert not _differing(runs)  # tokens and log-probs, bit for bit
    if widened:
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs[1].graph is not None


@pytest.mark.parametrize("device", ["cpu", "cpu-native"], ids=["int-mm", "packed"])
def test_tiny_model_is_batch_invariant_in_w8a8(tiny_llama, tiny_prompts, device):
    """W8A8 on torch's ``_int_mm`` (the plain cpu platform: 16-row tiles, each row's own outlier
    channels) and on cpu-native's packed kernel (unpadded calls)."""
    targets = [0, 13, 27, 39]

    def factory(**options):
        return LLM(
            tiny_llama[0],
            dtype="bfloat16",
            num_blocks=512,
            batch_invariant=True,
            quantization="int8-w8a8",
            device=device,
            **options,
        )

    assert not _differing(_runs(factory, tiny_prompts, targets, 24))


def test_the_check_sees_batch_effects_without_the_mode(tiny_llama, tiny_prompts):
    """Without the mode, over the torch attention backend (which batches decode rows and
    attends prompts with the flash kernel), the same comparison finds log-probs that differ:
    the test above is not passing because batches never matter. (Over cpu-native attention
    this tiny model's default mode happens to agree too: its rows are attended alone.)"""
    targets = [0, 13, 27, 39]

    def factory(**options):
        return LLM(tiny_llama[0], dtype="bfloat16", num_blocks=512, attention_backend="torch", **options)

    assert _differing(_runs(factory, tiny_prompts, targets, 24))


def test_batch_invariant_keeps_chunking_and_prefix_caching_over_chunk_invariant_attention(tiny_llama):
    llm = LLM(tiny_llama[0], dtype="float32", num_blocks=64, batch_invariant=True, max_num_batched_tokens=64)
    config = llm.engine.config
    assert llm.engine.attention.chunk_invariant and llm.engine.determinism() == "batch-invariant"
    assert config.cache.enable_prefix_caching and config.scheduler.enable_chunked_prefill
    assert config.scheduler.max_num_batched_tokens == 64


def test_batch_invariant_turns_off_chunking_and_prefix_caching_over_other_attention(tiny_llama):
    """The torch backend attends a whole prompt with the flash kernel and a later chunk row by
    row: the mode then prefills every prompt whole, never from cached blocks."""
    llm = LLM(
        tiny_llama[0],
        dtype="float32",
        num_blocks=64,
        batch_invariant=True,
        max_num_batched_tokens=64,
        attention_backend="torch",
    )
    config = llm.engine.config
    assert config.batch_invariant and not config.cache.enable_prefix_caching
    assert not config.scheduler.enable_chunked_prefill
    assert config.scheduler.max_num_batched_tokens == config.model.max_model_len  # a whole prompt per step


@pytest.mark.parametrize("declared", [True, False])
def test_the_mode_runs_the_platforms_layer_ops_where_they_declare_it(tiny_llama, monkeypatch, declared):
    """cpu-native's fused norms, rotary and SwiGLU compute each row alone (the kit checks the
    declaration), so the mode keeps them; ops that do not declare it give way to the plain ones."""
    from engine.layers import LayerOps, RMSNorm
    from engine_platforms_cpu_native.ops import NativeLayerOps

    monkeypatch.setattr(NativeLayerOps, "row_invariant", declared)
    llm = LLM(tiny_llama[0], dtype="float32", num_blocks=64, batch_invariant=True)
    norms = [m for m in llm.engine.model.modules() if isinstance(m, RMSNorm)]
    assert norms and {type(n.ops) for n in norms} == {NativeLayerOps if declared else LayerOps}


@pytest.mark.slow
def test_default_model_is_batch_invariant(default_tokenizer):
    """The acceptance case: the embedded default model (GGUF kept quantized, bf16 activations)."""
    prompts = _prompts(default_tokenizer, 32)
    assert not _differing(_runs(lambda **o: LLM(batch_invariant=True, **o), prompts, [5, 19, 31], 32))


@pytest.mark.slow
def test_default_model_is_batch_invariant_in_bf16(default_tokenizer):
    """The mode's fast path: the default model's weights in bf16, GEMMs in probed row buckets."""
    prompts = _prompts(default_tokenizer, 16)  # bf16 GEMMs without AVX-512 are slow: a smaller batch
    runs = _runs(
        lambda **o: LLM(quantization="unquantized", batch_invariant=True, **o), prompts, [3, 9, 15], 24
    )
    assert not _differing(runs)


@pytest.mark.parametrize("tiles", [False, True], ids=["int8-kernel", "tiles-forced"])
def test_a_gguf_model_keeps_its_tapes_and_the_heads_tokens_under_the_mode(tmp_path, monkeypatch, tiles):
    """cpu-native's layer ops declare ``row_invariant`` and its packed weights their
    ``invariant_rows`` (any number on the int8 kernel), so the mode runs them as the default
    mode does: decode steps on native tapes, greedy ones on the LM head's tokens — the same
    tokens for each request alone, among 24 and beside a request asking for log-probs (whose
    steps score the logits). Where AMX tiles would take steps over 16 rows (forced here: their
    plain C), whose bits differ from a row's alone, the mode keeps the weights off them
    (``invariant_at_any_rows``: no int8 copy of the table either), and runs the same way."""
    from gguf import GGMLQuantizationType

    from engine.layers.decoder import DecoderForCausalLM
    from engine.testing import reference
    from engine.testing.quant import TINY_LLAMA
    from engine_platforms_cpu_native import affine, logits
    from engine_quant_gguf.writer import write_gguf

    if tiles:
        for module, name in ((affine, "amx_tiles"), (affine, "int8_tiles"), (logits, "int8_tiles")):
            monkeypatch.setattr(module, name, lambda: True)
    config = dict(TINY_LLAMA, vocab_size=1000)
    path = str(tmp_path / "tiny.gguf")
    model = reference.tiny_checkpoint(str(tmp_path / "hf"), "LlamaForCausalLM", config)
    write_gguf(path, model, None, GGMLQuantizationType.Q4_0)
    heads_tokens = []
    compute_greedy = DecoderForCausalLM.compute_greedy

    def counted(self, hidden):
        tokens = compute_greedy(self, hidden)
        heads_tokens.append((hidden.shape[0], tokens is not None))
        return tokens

    monkeypatch.setattr(DecoderForCausalLM, "compute_greedy", counted)
    llm = LLM(
        path, dtype="bfloat16", max_num_seqs=32, num_blocks=200, max_model_len=256, batch_invariant=True
    )
    prompts = reference.random_prompts(config["vocab_size"], [5 + 3 * i for i in range(24)], seed=4)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.graphs[24].greedy is not None
    assert {taken for rows, taken in heads_tokens if rows == 24} == {True}
    packed = [m for m in llm.engine.model.modules() if isinstance(m, affine.PackedAffine)]
    assert packed and not any(m.on_tiles or m.int8_table is not None for m in packed)
    alone = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts[::5]]
    scored = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    beside = llm.generate([*prompts, prompts[0]], [greedy] * 24 + [scored])
    assert alone == batched[::5]
    assert [o.outputs[0].token_ids for o in beside[:24]] == batched
