"""LoRA adapters against ``transformers`` + ``peft``: tiny random Llama and Qwen3 checkpoints,
four random PEFT adapters of ranks 8/16/32 over different target sets (one rsLoRA), served in
one mixed batch with base-model rows: each request's greedy tokens equal the merged model's and
its prompt log-probs agree within float32 rounding — with room to spare, with prompts split by
chunked prefill, and with a KV pool small enough to preempt. Then the prefix cache (adapters
never share blocks), the scheduler's ``max_loras`` limit and LRU, and the adapters refused."""

from __future__ import annotations

import shutil

import attrs
import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.config import EngineConfig
from engine.testing import reference

peft = pytest.importorskip("peft")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = [  # (LoraConfig fields, seed)
    (dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]), 1),
    (dict(r=16, lora_alpha=32, target_modules=ALL_TARGETS), 2),
    (dict(r=32, lora_alpha=16, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]), 3),
    (
        dict(
            r=16,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
        ),
        4,
    ),
]
TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
# head_dim wider than hidden / heads: q_proj's output is not the hidden size
TINY_QWEN3 = {**TINY_LLAMA, "model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": True}
FAMILIES = {"llama": ("LlamaForCausalLM", TINY_LLAMA), "qwen3": ("Qwen3ForCausalLM", TINY_QWEN3)}
LENGTHS = [21, 7, 40, 13, 33, 5, 26, 18, 37, 11]
ADAPTER_OF_PROMPT = [None, 1, 2, 3, 4, None, 2, 4, 1, 3]  # base rows and four adapters interleaved
NEW_TOKENS = 8


def save_adapter(base_folder: str, folder: str, seed: int, **lora_config):
    """A PEFT adapter over the checkpoint at ``base_folder`` with random non-zero A and B (PEFT
    starts B at zero), saved as ``save_pretrained`` writes it; returns the merged model."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(**lora_config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()


def build_family(name: str, root) -> tuple:
    """(base folder, base model, {adapter id: (LoRARequest, merged model)})."""
    architecture, config = FAMILIES[name]
    base_folder = str(root / "base")
    base = reference.tiny_checkpoint(base_folder, architecture, config, seed=7)
    adapters = {}
    for lora_id, (fields, seed) in enumerate(ADAPTERS, start=1):
        folder = str(root / f"adapter-{lora_id}")
        merged = save_adapter(base_folder, folder, seed, **fields)
        adapters[lora_id] = (LoRARequest(f"adapter-{lora_id}", lora_id, folder), merged)
    return base_folder, base, adapters


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_family("llama", tmp_path_factory.mktemp("lora-llama"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_family("qwen3", tmp_path_factory.mktemp("lora-qwen3"))


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.getfixturevalue(request.param)


def hf_prompt_logprobs(model, prompt: list[int]) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = logits.log_softmax(-1)[:-1]
    return logprobs.gather(1, torch.tensor(prompt[1:])[:, None]).flatten().tolist()


def engine_prompt_logprobs(output) -> list[float]:
    return [
        position[token].logprob
        for token, position in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:])
    ]


def lora_llm(base_folder: str, **options) -> LLM:
    options = {"max_loras": 4, "max_lora_rank": 32, "num_blocks": 256, "block_size": 8, **options}
    return LLM(base_folder, dtype="float32", enable_lora=True, max_model_len=128, **options)


SQUEEZES = {
    "roomy": {},
    "chunked": dict(max_num_batched_tokens=16),  # every prompt over 16 tokens is split
    "preempted": dict(max_num_batched_tokens=32, num_blocks=24, max_num_seqs=8),  # 184 tokens of KV
}


@pytest.mark.parametrize("squeeze", sorted(SQUEEZES))
def test_mixed_batch_matches_peft(family, squeeze):
    base_folder, base, adapters = family
    prompts = reference.random_prompts(256, LENGTHS, seed=5)
    requests = [None if i is None else adapters[i][0] for i in ADAPTER_OF_PROMPT]
    llm = lora_llm(base_folder, **SQUEEZES[squeeze])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params, lora_request=requests)
    if squeeze == "preempted":
        assert llm.engine.stats()["preemptions"] > 0, "the KV pool must be small enough to preempt"
    for prompt, lora_id, out in zip(prompts, ADAPTER_OF_PROMPT, outs):
        model = base if lora_id is None else adapters[lora_id][1]
        expected = reference.hf_greedy(model, [prompt], NEW_TOKENS)[0]
        assert out.outputs[0].token_ids == expected, f"adapter {lora_id}"
        torch.testing.assert_close(
            engine_prompt_logprobs(out), hf_prompt_logprobs(model, prompt), rtol=0, atol=2e-4
        )


def test_decode_steps_replay_native_tapes_with_adapters(llama, tmp_path):
    """On a base whose decode step is C kernels alone (GGUF Q8_0 on cpu-native), steps of mixed
    adapters replay the recorded tapes — the LoRA kernels read the step's slots from the bucket's
    static buffer — and give the tokens of the same engine run eagerly; a later batch without
    adapters replays with every row back on the base model. Ten requests decode in a bucket
    above 8, which the first such step records: that step still runs each row's adapter."""
    from gguf import GGMLQuantizationType

    from engine_quant_gguf.writer import write_gguf

    _, base, adapters = llama
    path = str(tmp_path / "base.gguf")
    write_gguf(path, base, None, GGMLQuantizationType.Q8_0)
    llm = lora_llm(path)
    graphs = llm.engine.runner.graphs
    if graphs is None:
        pytest.skip("this platform records no step graphs")
    replayed = []  # a greedy step replays with its tokens (replay_greedy), others the forward
    replay, replay_greedy = graphs.replay, graphs.replay_greedy
    graphs.replay = lambda batch: replayed.append(hidden := replay(batch)) or hidden
    graphs.replay_greedy = lambda batch, *steps: (
        replayed.append(tokens := replay_greedy(batch, *steps)) or tokens
    )
    prompts = reference.random_prompts(256, [9, 14, 6, 11, 17, 8, 12, 5, 10, 15], seed=31)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    eager = lora_llm(path, enforce_eager=True)
    for lora_ids in ([None, 1, 2, 3, 4], [None] * 5, [None, 1, 2, 3, 4] * 2):
        requests = [i and adapters[i][0] for i in lora_ids]
        batch = prompts[: len(lora_ids)]
        assert [o.outputs[0].token_ids for o in llm.generate(batch, params, lora_request=requests)] == [
            o.outputs[0].token_ids for o in eager.generate(batch, params, lora_request=requests)
        ], lora_ids
    steps = [
        1 if out.dim() == 1 or out.is_floating_point() else out.shape[1]
        for out in replayed
        if out is not None
    ]
    assert sum(steps) >= 3 * (NEW_TOKENS - 1)  # a burst of greedy steps replays once a step
    assert 10 in graphs.graphs


def test_adapters_change_the_output(family):
    """The four adapters and the base model all continue the same prompt differently, so
    matching peft above is not matching the base model."""
    _, base, adapters = family
    prompt = reference.random_prompts(256, [24], seed=9)[0]
    answers = {
        tuple(reference.hf_greedy(m, [prompt], NEW_TOKENS)[0])
        for m in [base] + [m for _, m in adapters.values()]
    }
    assert len(answers) == 5


def test_at_most_max_loras_adapters_per_step_and_others_wait_without_blocking(llama):
    """max_loras=1: a step never mixes two adapters (the runner refuses one that does), base
    rows run beside the adapter's, and an adapter that must wait holds up nobody behind it."""
    base_folder, base, adapters = llama
    llm = lora_llm(base_folder, max_loras=1, max_cpu_loras=2)
    steps: list[set] = []
    prepare = llm.engine.runner.lora.prepare
    llm.engine.runner.lora.prepare = lambda rows: (
        steps.append({r and r.lora_int_id for r, _ in rows}),
        prepare(rows),
    )[1]
    prompts = reference.random_prompts(256, [12, 9, 10, 8], seed=13)
    order = [1, 2, None, 1]
    requests = [adapters[1][0], adapters[2][0], None, adapters[1][0]]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), lora_request=requests
    )
    assert all(len(step - {None}) <= 1 for step in steps)
    assert steps[0] == {1, None}, "the base request and adapter 1's second request pass the waiting adapter 2"
    for prompt, lora_id, out in zip(prompts, order, outs):
        model = base if lora_id is None else adapters[lora_id][1]
        assert out.outputs[0].token_ids == reference.hf_greedy(model, [prompt], 4)[0]


def test_loaded_adapters_beyond_max_cpu_loras_are_dropped_least_recent_first(llama):
    base_folder, _, adapters = llama
    llm = lora_llm(base_folder, max_loras=1, max_cpu_loras=2)
    prompt = reference.random_prompts(256, [10], seed=17)[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for lora_id in (1, 2, 3):
        llm.generate([prompt], params, lora_request=adapters[lora_id][0])
    assert llm.engine.lora.loaded == (2, 3)
    out = llm.generate([prompt], params, lora_request=adapters[1][0])[0]  # read again from its folder
    assert llm.engine.lora.loaded == (3, 1)
    assert out.outputs[0].token_ids == reference.hf_greedy(adapters[1][1], [prompt], 4)[0]


def test_prefix_cache_never_shares_blocks_across_adapters(llama):
    base_folder, _, adapters = llama
    llm = lora_llm(base_folder)
    prompt = reference.random_prompts(256, [40], seed=19)[0]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def cached(lora_id):
        lora = None if lora_id is None else adapters[lora_id][0]
        return llm.generate([prompt], params, lora_request=lora)[0].num_cached_tokens

    assert cached(1) == 0
    assert cached(2) == 0, "adapter 2 must not hit adapter 1's blocks"
    assert cached(None) == 0, "the base model must not hit an adapter's blocks"
    assert cached(1) == 32, "the same adapter hits its own full blocks"
    assert cached(None) == 32


def test_kv_events_carry_the_adapter_id():
    from engine.builtin.kv_cache_manager import PrefixCachingKVCacheManager
    from engine.client.kv_events import wire_event
    from engine.messages.kv_events import BlockStored, block_hashes
    from engine.messages.request import Request

    config = EngineConfig.from_kwargs(block_size=4, kv_events_config={"enable_kv_cache_events": True})
    manager = PrefixCachingKVCacheManager(config, 16)
    lora = LoRARequest("a", 7, "unused")
    tokens = list(range(1, 10))
    for rid, adapter in (("with", lora), ("without", None)):
        request = Request(rid, tokens, SamplingParams(), lora_request=adapter)
        assert manager.allocate_slots(request, len(tokens))
    with_adapter, without = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    assert with_adapter.lora_id == 7 and without.lora_id is None
    assert set(with_adapter.block_hashes).isdisjoint(without.block_hashes)
    assert wire_event(with_adapter, "CPU").lora_id == 7
    same = Request("again", tokens, SamplingParams(), lora_request=lora)
    assert block_hashes(same, 4) == list(with_adapter.block_hashes)


# --- what is refused, each with its reason; the engine keeps serving -------------------------


@pytest.fixture(scope="module")
def refusing(llama, tmp_path_factory):
    """An engine with max_lora_rank 16, and a folder to write bad adapters in."""
    return lora_llm(llama[0], max_lora_rank=16), tmp_path_factory.mktemp("bad-adapters"), llama


def _refused(llm, lora: LoRARequest, match: str):
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_request=lora)
    assert not llm.engine.has_unfinished(), "nothing is queued for a refused adapter"


def test_rank_above_max_lora_rank_is_refused(refusing):
    llm, _, (_, _, adapters) = refusing
    _refused(llm, adapters[3][0], r"rank 32, above max_lora_rank=16")


@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_vocabulary_targets_are_refused(refusing, target):
    llm, root, (base_folder, _, _) = refusing
    folder = str(root / target)
    save_adapter(base_folder, folder, 5, r=8, lora_alpha=8, target_modules=["q_proj", target])
    _refused(llm, LoRARequest(target, 50, folder), "token embeddings or the LM head.*not supported")


def test_an_adapter_for_another_shape_is_refused(refusing, tmp_path):
    llm, root, _ = refusing
    other = str(tmp_path / "wider")
    reference.tiny_checkpoint(other, "LlamaForCausalLM", {**TINY_LLAMA, "hidden_size": 96}, seed=1)
    save_adapter(other, str(root / "wider"), 5, r=8, lora_alpha=8, target_modules=["q_proj"])
    _refused(
        llm, LoRARequest("wider", 51, str(root / "wider")), r"does not match the base model's \[64 x 64\]"
    )


def test_a_target_the_model_lacks_is_refused(refusing, tmp_path):
    llm, root, _ = refusing
    deeper = str(tmp_path / "deeper")
    reference.tiny_checkpoint(deeper, "LlamaForCausalLM", {**TINY_LLAMA, "num_hidden_layers": 3}, seed=1)
    save_adapter(deeper, str(root / "deeper"), 5, r=8, lora_alpha=8, target_modules=["down_proj"])
    _refused(
        llm,
        LoRARequest("deeper", 52, str(root / "deeper")),
        r"layers\.2\.mlp\.down_proj, which the base model lacks",
    )


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_safetensors_file_is_refused(refusing, damage):
    llm, root, (_, _, adapters) = refusing
    folder = root / damage
    shutil.copytree(adapters[1][0].lora_path, folder)
    weights = folder / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x08" + data[1:64])
    _refused(llm, LoRARequest(damage, 53, str(folder)), "adapter_model.safetensors is corrupt or truncated")


def test_missing_folders_and_reused_ids_are_refused(refusing, tmp_path):
    llm, _, (_, _, adapters) = refusing
    _refused(llm, LoRARequest("nowhere", 54, str(tmp_path / "nowhere")), "no adapter_config.json")
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1), lora_request=adapters[1][0])
    other = attrs.evolve(adapters[2][0], lora_int_id=1)
    _refused(llm, other, "lora_int_id 1 is adapter 'adapter-1'.*needs an id of its own")


def test_the_engine_serves_after_refusals(refusing):
    llm, _, (_, base, adapters) = refusing
    prompt = [5, 6, 7, 8]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = llm.generate([prompt, prompt], params, lora_request=[adapters[2][0], None])
    assert outs[0].outputs[0].token_ids == reference.hf_greedy(adapters[2][1], [prompt], 3)[0]
    assert outs[1].outputs[0].token_ids == reference.hf_greedy(base, [prompt], 3)[0]


def test_requests_without_enable_lora_or_with_a_wrong_count_are_refused(llama):
    base_folder, _, adapters = llama
    llm = LLM(base_folder, dtype="float32", num_blocks=64, max_model_len=128)
    with pytest.raises(ValueError, match="LoRA is not enabled; start the engine with enable_lora=True"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=1), lora_request=adapters[1][0])
    with pytest.raises(ValueError, match="lora_request: 1 given for 2 prompts"):
        llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=1), lora_request=[adapters[1][0]])


def test_lora_options_are_checked():
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be at least max_loras \(2\)"):
        EngineConfig.from_kwargs(enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("a", 0, "path")


def test_the_engine_core_process_carries_adapters_over_zmq(llama, tmp_path):
    """The client the server uses: requests with adapters cross the socket to the engine-core
    process and come back as peft's tokens; a refused adapter fails that request alone."""
    import asyncio

    from engine.client.async_engine import AsyncEngine

    base_folder, base, adapters = llama
    prompt = reference.random_prompts(256, [12], seed=23)[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    options = dict(
        model=base_folder, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=32, num_blocks=64
    )

    async def run() -> dict[str, object]:
        engine = AsyncEngine(options)
        await engine.start()
        try:
            handles = {
                rid: engine.submit([(rid, prompt, params)], lora_request=lora)
                for rid, lora in [
                    ("base", None),
                    ("a2", adapters[2][0]),
                    ("a4", adapters[4][0]),
                    ("missing", LoRARequest("missing", 9, str(tmp_path / "missing"))),
                ]
            }
            return {rid: [d async for d in handle.deltas()] for rid, handle in handles.items()}
        finally:
            await engine.shutdown()

    deltas = asyncio.run(run())
    for rid, model in [("base", base), ("a2", adapters[2][1]), ("a4", adapters[4][1])]:
        tokens = [t for d in deltas[rid] for t in d.token_ids]
        assert tokens == reference.hf_greedy(model, [prompt], 4)[0], rid
    [failed] = deltas["missing"]
    assert failed.finish_reason == "error" and "no adapter_config.json" in failed.error


def test_lora_flags_are_engine_options():
    from engine.entrypoints.cli_args import ArgumentParser, add_engine_arguments, engine_options

    parser = ArgumentParser(prog="engine")
    add_engine_arguments(parser)
    argv = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "32", "--max-cpu-loras", "8"]
    options = engine_options(parser.parse_args(argv))
    assert options == dict(enable_lora=True, max_loras=4, max_lora_rank=32, max_cpu_loras=8)
    lora = EngineConfig.from_kwargs(**options).lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.cpu_loras) == (True, 4, 32, 8)
    text = parser.format_help()
    for flag in ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras"):
        assert flag in text
    assert "higher is refused" in text and "default: 16" in text


def test_a_scheduler_that_does_not_serve_lora_is_refused(llama):
    from engine.plugins import add_plugin
    from tests.plugins import fcfs_scheduler

    add_plugin(fcfs_scheduler, "test-fcfs")
    with pytest.raises(ValueError, match="scheduler 'test-fcfs' does not keep a step within max_loras"):
        lora_llm(llama[0], scheduler="test-fcfs")


@pytest.mark.parametrize("quantization", ["gguf-q8_0", "int8-w8a16"])
def test_adapters_run_on_a_base_kept_quantized(llama, tmp_path, quantization):
    """The base matmul stays the quant method's; the adapters' deltas are added to it. Measured
    teacher-forced, as quantized paths are: each prompt's log-probs under an adapter are as near
    transformers + peft on the float weights as the quantized base model is to the float one
    (the quantization error, and no more), and far from the model without the adapter."""
    base_folder, base, adapters = llama
    if quantization.startswith("gguf"):
        from gguf import GGMLQuantizationType

        from engine_quant_gguf.writer import write_gguf

        path = str(tmp_path / "base.gguf")
        write_gguf(path, base, None, GGMLQuantizationType.Q8_0)
        llm = lora_llm(path)
    else:
        llm = lora_llm(base_folder, quantization=quantization)
    prompts = reference.random_prompts(256, [30] * 3, seed=29)
    chosen = [2, 3, 4]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    requests = [adapters[lora_id][0] for lora_id in chosen] + [None] * 3
    outs = llm.generate(prompts * 2, params, lora_request=requests)
    for prompt, lora_id, with_adapter, without in zip(prompts, chosen, outs, outs[3:]):
        merged = torch.tensor(hf_prompt_logprobs(adapters[lora_id][1], prompt))
        float_base = torch.tensor(hf_prompt_logprobs(base, prompt))
        got = torch.tensor(engine_prompt_logprobs(with_adapter))
        quantization_error = (torch.tensor(engine_prompt_logprobs(without)) - float_base).abs().mean().item()
        error = (got - merged).abs().mean().item()
        assert error < 2 * quantization_error + 0.01, (
            f"adapter {lora_id}: {error:.4f} ({quantization_error:.4f})"
        )
        assert (got - float_base).abs().mean().item() > 5 * error, f"adapter {lora_id} is barely applied"


def test_an_id_given_to_other_files_once_dropped_is_refilled_in_its_slot(llama):
    """Adapter 1 holds a slot but has left the loaded set; a request naming id 1 with adapter 4's
    files then runs adapter 4's weights, not the slot's stale ones. (The id is the adapter's
    identity in the prefix cache too, so the prompts differ: blocks cached under id 1 would be
    reused.)"""
    base_folder, _, adapters = llama
    llm = lora_llm(base_folder, max_loras=2, max_cpu_loras=2)
    prompt, other_prompt = reference.random_prompts(256, [10, 10], seed=31)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([prompt, prompt], params, lora_request=[adapters[1][0], adapters[2][0]])
    for lora_id in (3, 4):  # checked and loaded, never run: the slots keep adapters 1 and 2
        llm.client.validate(prompt, params, 0, adapters[lora_id][0])
    assert llm.engine.lora.loaded == (3, 4)
    renamed = LoRARequest("renamed", 1, adapters[4][0].lora_path)
    out = llm.generate([other_prompt], params, lora_request=renamed)[0]
    assert out.outputs[0].token_ids == reference.hf_greedy(adapters[4][1], [other_prompt], 4)[0]


def test_a_rank_64_adapter_under_max_lora_rank_64(llama, tmp_path):
    base_folder, _, adapters = llama
    folder = str(tmp_path / "rank-64")
    merged = save_adapter(base_folder, folder, 6, r=64, lora_alpha=32, target_modules=ALL_TARGETS)
    llm = lora_llm(base_folder, max_lora_rank=64, max_loras=2)
    prompts = reference.random_prompts(256, [15, 15], seed=37)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=[LoRARequest("rank-64", 64, folder), adapters[1][0]])
    assert outs[0].outputs[0].token_ids == reference.hf_greedy(merged, prompts[:1], 6)[0]
    assert outs[1].outputs[0].token_ids == reference.hf_greedy(adapters[1][1], prompts[1:], 6)[0]


def test_adapters_on_the_attention_of_a_mixture_of_experts_model(tmp_path):
    """Qwen3-MoE: adapters of q/k/v/o run on its attention layers (the experts take none)."""
    from engine_models_moe.model import MoeForCausalLM

    config = MoeForCausalLM.example_configs()["Qwen3MoeForCausalLM"]
    base_folder = str(tmp_path / "base")
    base = reference.tiny_checkpoint(base_folder, "Qwen3MoeForCausalLM", config, seed=5)
    folder = str(tmp_path / "adapter")
    merged = save_adapter(
        base_folder, folder, 8, r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    llm = lora_llm(base_folder, max_loras=1)
    prompts = reference.random_prompts(config["vocab_size"], [14, 9], seed=41)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=[LoRARequest("moe", 1, folder), None])
    adapted = reference.hf_greedy(merged, prompts[:1], 6)[0]
    assert adapted != reference.hf_greedy(base, prompts[:1], 6)[0], "the adapter must matter"
    assert outs[0].outputs[0].token_ids == adapted
    assert outs[1].outputs[0].token_ids == reference.hf_greedy(base, prompts[1:], 6)[0]
