"""Step graphs for decode (engine.runner.step_graphs), the parts any platform shares: the
capture sizes and bucket choice, the padding of a decode step to a bucket (the real rows'
attention unchanged by the padding rows), the static buffers overwritten in place, why graphs
are off, the KV budget they take, a failed recording falling back to eager, and the plain cpu
platform never recording while accepting ``--enforce-eager`` and ``--cuda-graph-sizes``. CUDA
graphs' capture and replay need a device; native tapes are tested in tests/test_native_tape.py."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.builtin.platforms import CpuPlatform, CudaGraphs, CudaPlatform
from engine.config import EngineConfig
from engine.core import kv_sizing
from engine.interfaces import AttentionSpec
from engine.runner import decode_inputs, step_graphs
from engine.runner.layer_attention import LayerAttention
from engine.testing import reference
from engine.testing.attention import paged_layout
from engine.testing.step_graphs import replayed_tokens
from engine_attention_torch.backend import TorchAttentionBackend
from tests.test_cli_args import parse

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=8)


def test_default_sizes_follow_vllms_list_up_to_max_num_seqs():
    default_sizes = CudaGraphs().default_sizes
    assert default_sizes(256) == (1, 2, 4, *range(8, 256, 8), 256)
    assert default_sizes(3) == (1, 2, 3)
    assert default_sizes(100)[-3:] == (88, 96, 100)
    big = default_sizes(4096)
    assert big[-2:] == (496, 512) and 264 not in big and 272 in big


def test_configured_sizes_are_sorted_and_capped():
    assert step_graphs.capture_sizes([8, 1, 8, 600], (1, 2), 256) == (1, 8)
    assert step_graphs.capture_sizes([600], (1, 2), 256) == ()
    assert step_graphs.capture_sizes(None, (1, 2), 256) == (1, 2)
    with pytest.raises(ValueError, match="cuda_graph_sizes: batch sizes must be positive"):
        step_graphs.capture_sizes([0, 4], (1, 2), 256)


@pytest.mark.parametrize("batch, bucket", [(1, 1), (3, 4), (4, 4), (5, 8), (17, 24), (256, 256), (257, None)])
def test_bucket_is_the_smallest_that_holds_the_batch(batch, bucket):
    assert step_graphs.bucket_for(batch, CudaGraphs().default_sizes(256)) == bucket


def _decode_layout():
    requests = [(5, 1), (20, 1), (0, 1)]
    return paged_layout([(ctx, n) for ctx, n in requests], [[4, 2, 9], [7, 3, 11], [5]], 8)


def test_only_single_row_steps_of_one_kv_group_are_uniform_decode():
    decode = _decode_layout()
    assert step_graphs.is_uniform_decode([decode])
    assert not step_graphs.is_uniform_decode([decode, decode])
    assert not step_graphs.is_uniform_decode([paged_layout([(0, 3), (4, 1)], [[1], [2]], 8)])


def test_padding_rows_read_and_write_the_null_block():
    layout = _decode_layout()
    ids, positions = torch.tensor([11, 12, 13]), torch.tensor([5, 20, 0])
    padded = decode_inputs.pad_decode(ids, positions, layout, 5, max_blocks=6)
    assert padded.input_ids.tolist() == [11, 12, 13, 0, 0] and padded.positions.tolist() == [5, 20, 0, 0, 0]
    out = padded.layout
    assert out.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5] and out.query_lens == (1,) * 5
    assert out.seq_lens.tolist() == [6, 21, 1, 1, 1] and out.seq_lens_host == (6, 21, 1, 1, 1)
    assert out.slot_mapping.tolist() == [*layout.slot_mapping.tolist(), 0, 0]
    assert out.block_table.shape == (5, 6) and out.block_table[:3, :3].tolist() == layout.block_table.tolist()
    assert not out.block_table[3:].any() and not out.block_table[:, 3:].any()
    with pytest.raises(ValueError, match="does not fit a 2-row graph"):
        decode_inputs.pad_decode(ids, positions, layout, 2, max_blocks=6)


def test_padding_leaves_the_real_rows_attention_unchanged():
    """The real rows of a padded decode step attend as they would unpadded (the torch backend
    as the judge: any backend reading the layout as the interface defines it)."""
    backend = TorchAttentionBackend(SPEC, CpuPlatform())
    layout = _decode_layout()
    padded = decode_inputs.pad_decode(
        torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), layout, 8, max_blocks=4
    ).layout
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(backend.kv_cache_shape(16), generator=gen)
    q, k, v = (torch.randn(8, h, 16, generator=gen) for h in (4, 2, 2))
    alone = backend.forward(q[:3], k[:3], v[:3], cache.clone(), backend.build_metadata(layout))
    together = backend.forward(q, k, v, cache.clone(), backend.build_metadata(padded))
    torch.testing.assert_close(together[:3], alone)


def test_static_buffers_are_overwritten_in_place():
    static = step_graphs.DecodeInputs.empty(4, 5, "cpu")
    pointers = [
        t.data_ptr() for t in (static.input_ids, static.layout.block_table, static.layout.slot_mapping)
    ]
    layout = _decode_layout()
    static.copy_(decode_inputs.pad_decode(torch.tensor([1, 2, 3]), torch.tensor([5, 20, 0]), layout, 4, 5))
    assert [
        t.data_ptr() for t in (static.input_ids, static.layout.block_table, static.layout.slot_mapping)
    ] == pointers
    assert static.input_ids.tolist() == [1, 2, 3, 0] and static.layout.seq_lens.tolist() == [6, 21, 1, 1]
    assert static.layout.block_table[:3, :3].tolist() == layout.block_table.tolist()


def test_filling_in_place_matches_padding_over_a_previous_step():
    """A replay fills its static buffers in place: what a previous, larger step left there
    (every row real, every block column used) must read as padding again."""
    static = step_graphs.DecodeInputs.empty(4, 5, "cpu")
    full = paged_layout([(39, 1)] * 4, [[7, 8, 9, 10, 11]] * 4, 8)
    static.fill(torch.arange(4) + 1, torch.arange(4) + 30, full)
    layout = _decode_layout()
    ids, positions = torch.tensor([1, 2, 3]), torch.tensor([5, 20, 0])
    static.fill(ids, positions, layout)
    padded = decode_inputs.pad_decode(ids, positions, layout, 4, 5)
    for name in ("input_ids", "positions"):
        assert torch.equal(getattr(static, name), getattr(padded, name))
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        assert torch.equal(getattr(static.layout, name), getattr(padded.layout, name))
    with pytest.raises(ValueError, match="does not fit a 4-row graph of 5 blocks"):
        static.fill(torch.arange(4), torch.arange(4), paged_layout([(47, 1)] * 4, [list(range(6))] * 4, 8))


class GraphableBackend(TorchAttentionBackend):
    cuda_graph_support = "decode-only"


def _layers(backend_cls=GraphableBackend) -> LayerAttention:
    return LayerAttention((backend_cls(SPEC, CpuPlatform()),), (0, 0), (0, 0))


def test_graphs_are_planned_on_cuda_with_a_backend_that_declares_them():
    plan = step_graphs.graph_plan(
        EngineConfig.from_kwargs(max_num_seqs=16), CudaPlatform(), _layers(), "generate"
    )
    assert isinstance(plan.graphs, CudaGraphs) and plan.sizes == (1, 2, 4, 8, 16) and plan.reasons == ()


@pytest.mark.parametrize(
    "options, platform, backend, runner, reason",
    [
        ({}, CpuPlatform(), GraphableBackend, "generate", "the cpu platform records no step graphs"),
        ({"enforce_eager": True}, CudaPlatform(), GraphableBackend, "generate", "enforce_eager is set"),
        (
            {},
            CudaPlatform(),
            TorchAttentionBackend,
            "generate",
            "attention backend torch declares cuda_graph_support 'none'",
        ),
        (
            {"speculative_config": {"method": "ngram"}},
            CudaPlatform(),
            GraphableBackend,
            "generate",
            "speculative decoding is configured",
        ),
        ({}, CudaPlatform(), GraphableBackend, "pooling", "the pooling runner samples nothing to decode"),
        (
            {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
            CudaPlatform(),
            GraphableBackend,
            "generate",
            "calculate_kv_scales: a recording would hold scales known after the first prefill",
        ),
        (
            {"cuda_graph_sizes": (512,)},
            CudaPlatform(),
            GraphableBackend,
            "generate",
            "cuda_graph_sizes leaves no size up to max_num_seqs",
        ),
    ],
)
def test_reasons_graphs_are_off(options, platform, backend, runner, reason):
    plan = step_graphs.graph_plan(EngineConfig.from_kwargs(**options), platform, _layers(backend), runner)
    assert plan.graphs is None and plan.sizes == () and any(r.startswith(reason) for r in plan.reasons), plan


def test_graph_memory_comes_out_of_the_kv_budget():
    """Activations of the largest bucket (one pool), the float32 logits of the largest greedy
    recording, and each recording's overhead: every bucket here has two (its greedy one)."""

    class Config:
        hidden_size, intermediate_size, vocab_size = 64, 256, 1000

    assert (
        step_graphs.graph_memory_estimate(step_graphs.GraphPlan(None, (), ("off",)), Config, torch.bfloat16)
        == 0
    )
    plan = step_graphs.GraphPlan(CudaGraphs(), (1, 2, 4, 8), ())
    expected = 8 * (8 * 64 + 4 * 256) * 2 + 8 * 1000 * 4 + 8 * CudaGraphs.overhead_bytes
    assert step_graphs.graph_memory_estimate(plan, Config, torch.bfloat16) == expected


def test_reserved_graph_memory_shrinks_a_kv_budget_taken_from_the_device():
    class FixedMemory(CpuPlatform):
        def free_memory(self) -> int:
            return 64 << 20

    layers, reserve = _layers(), 8 << 20
    per_block = 2 * 4 * 2 * SPEC.block_size * SPEC.num_kv_heads * SPEC.head_dim  # 2 layers, float32

    def blocks(**options) -> int:
        config = EngineConfig.from_kwargs(kv_cache_memory_fraction=0.5, **options)
        return kv_sizing.kv_cache_groups(config, layers, (None,), FixedMemory(), reserve)[0].num_blocks

    assert blocks() == ((32 << 20) - reserve) // per_block
    assert blocks(kv_cache_memory=16 << 20) == (16 << 20) // per_block  # a size given is the KV cache's own


def test_the_plain_cpu_platform_never_records(tiny_llama, monkeypatch):
    """Graphs on by default (no --enforce-eager) and off by flag: the cpu platform (no C kernels,
    no step graphs) never tries to record."""

    def refuse(self):
        raise AssertionError("a step graph recording was attempted on the cpu platform")

    monkeypatch.setattr(step_graphs.StepGraphRunner, "capture", refuse)
    for eager in (False, True):
        llm = LLM(
            tiny_llama[0],
            dtype="float32",
            num_blocks=64,
            block_size=16,
            enforce_eager=eager,
            cuda_graph_sizes=(1, 2),
            device="cpu",
        )
        assert llm.engine.runner.graphs is None
        assert len(llm.generate("hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_flags():
    assert parse("--enforce-eager", "--cuda-graph-sizes", "1,2,4") == {
        "enforce_eager": True,
        "cuda_graph_sizes": (1, 2, 4),
    }
    assert parse("--cuda-graph-sizes", "8 16")["cuda_graph_sizes"] == (8, 16)


def test_a_failed_capture_falls_back_to_eager(monkeypatch, caplog):
    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(step_graphs.StepGraphRunner, "capture", fail)
    plan = step_graphs.GraphPlan(CudaGraphs(), (1, 2), ())
    with caplog.at_level("INFO", logger="engine.runner.step_graphs"):
        assert step_graphs.start(None, None, [], plan, 4, CpuPlatform(), 256, 64) is None
    assert "recording CUDA graphs failed: operation not permitted" in caplog.text


def test_replay_catches_a_backend_whose_metadata_does_not_survive_overwrites(tiny_llama):
    """The CPU stand-in for graphs (``engine.testing.step_graphs``) tells a backend that could
    declare "decode-only" from one that must not: the torch backend sizes its gathers from the
    host lengths the capture saw (one key per row), so replayed decode steps give other tokens
    than eager ones (the Triton backend's own tests show it passing)."""
    prompts = reference.random_prompts(256, [5, 33, 3], seed=4)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 5, 7)]
    options = dict(
        dtype="float32", attention_backend="torch", num_blocks=64, block_size=16, max_model_len=128
    )
    eager = [o.outputs[0].token_ids for o in LLM(tiny_llama[0], **options).generate(prompts, params)]
    replayed, replays = replayed_tokens(LLM(tiny_llama[0], **options), prompts, params, (1, 2, 4))
    assert all(replays.values()) and replayed != eager
