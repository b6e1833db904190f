"""CUDA graphs for decode steps on the cuda platform.

At start-up the engine captures the model's forward once per batch bucket (``capture_sizes``:
vLLM's default list up to ``max_num_seqs``, or ``cuda_graph_sizes``) over static input
buffers; a step whose requests all have one query row (a uniform decode step) is padded to
the smallest bucket that holds it (:func:`pad_decode`: padding rows are token 0 at position 0,
one key in the null block, their outputs dropped) and replayed; any other step runs eagerly.
This needs an attention backend declaring ``cuda_graph_support`` "decode-only" or "full" (the
metadata it builds for the static buffers must stay valid as they are overwritten). The
graphs share one memory pool, captured largest first; :func:`graph_memory_estimate` is
taken out of the KV cache budget before it is sized (an estimate: the capture is not measured). ``enforce_eager`` turns all of this off,
and it is off wherever :func:`graph_plan` gives a reason (any platform but cuda among them).

Not yet run on a GPU: the capture and replay paths are written to the CUDA graph API as
documented; the bucket choice, padding and the reasons are tested on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import torch

from engine.interfaces import BatchLayout, StepContext

logger = logging.getLogger(__name__)

# per captured graph, beside the pool: its kernel nodes and the driver's bookkeeping
GRAPH_OVERHEAD_BYTES = 2 << 20


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default buckets (1, 2, 4, every 8 to 248, every 16 from 256 to 512) below
    ``max_num_seqs``, and ``max_num_seqs`` itself (at most 512): every batch the scheduler can
    form up to 512 has a bucket."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    return tuple(sorted({s for s in sizes if s < max_num_seqs} | {min(max_num_seqs, 512)}))


def capture_sizes(configured: Sequence[int] | None, max_num_seqs: int) -> tuple[int, ...]:
    """The buckets to capture: ``configured`` (sorted, deduplicated, those above
    ``max_num_seqs`` dropped) or the default list."""
    if configured is None:
        return default_capture_sizes(max_num_seqs)
    if any(s < 1 for s in configured):
        raise ValueError(f"cuda_graph_sizes: batch sizes must be positive, got {list(configured)}")
    return tuple(sorted({s for s in configured if s <= max_num_seqs}))


def bucket_for(num_requests: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``num_requests`` (sizes ascending); None: none does."""
    return next((s for s in sizes if s >= num_requests), None)


def is_uniform_decode(layouts: Sequence[BatchLayout]) -> bool:
    """One KV cache group and every request one query row."""
    return len(layouts) == 1 and all(q == 1 for q in layouts[0].query_lens)


@attrs.frozen
class DecodeInputs:
    """A decode step's inputs at a fixed batch size (the static buffers' shapes)."""

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    layout: BatchLayout  # block_table [B, max_blocks]

    @classmethod
    def empty(cls, size: int, max_blocks: int, device) -> DecodeInputs:
        """All padding: what the graph is captured over."""
        zeros = torch.zeros(size, dtype=torch.int64, device=device)
        return cls(zeros, zeros.clone(), BatchLayout(
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(size, dtype=torch.int32, device=device),
            block_table=torch.zeros(size, max_blocks, dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(size, dtype=torch.int64, device=device),
            query_lens=(1,) * size, seq_lens_host=(1,) * size))

    def copy_(self, other: DecodeInputs) -> None:
        """Overwrite these buffers in place with ``other`` of the same shapes."""
        for mine, theirs in ((self.input_ids, other.input_ids), (self.positions, other.positions),
                             *((getattr(self.layout, f), getattr(other.layout, f))
                               for f in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"))):
            mine.copy_(theirs, non_blocking=True)


def pad_decode(input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout, size: int,
               max_blocks: int) -> DecodeInputs:
    """A uniform decode step of B ≤ ``size`` requests as ``size`` rows: padding rows are token
    0 at position 0 with one key, written to and read from slot 0 of the null block; the block
    table widened to ``max_blocks`` columns with the null block."""
    batch, device = layout.num_requests, input_ids.device
    pad = size - batch
    if pad < 0 or layout.block_table.shape[1] > max_blocks:
        raise ValueError(f"a decode step of {batch} requests and {layout.block_table.shape[1]} blocks does not fit "
                         f"a {size}-row graph of {max_blocks} blocks")
    table = torch.zeros(size, max_blocks, dtype=torch.int32, device=device)
    table[:batch, :layout.block_table.shape[1]] = layout.block_table
    zeros = torch.zeros(pad, dtype=torch.int64, device=device)
    return DecodeInputs(torch.cat([input_ids, zeros]), torch.cat([positions, zeros]), BatchLayout(
        query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
        seq_lens=torch.cat([layout.seq_lens, torch.ones(pad, dtype=torch.int32, device=device)]),
        block_table=table, slot_mapping=torch.cat([layout.slot_mapping, zeros]),
        query_lens=(1,) * size, seq_lens_host=(*layout.seq_lens_host, *(1,) * pad)))


def graph_plan(config, platform, layers, runner_kind: str) -> tuple[tuple[int, ...], list[str]]:
    """(the sizes to capture, why none are) for this engine: graphs need the cuda platform, a
    backend that declares support, one attention kind, and no KV connector, speculation or
    pooling (each reads or writes state around the forward that a replay would skip)."""
    reasons = []
    if config.enforce_eager:
        reasons.append("enforce_eager is set")
    if platform.device_type != "cuda":
        reasons.append(f"the {platform.name} platform has no CUDA graphs")
    unsupported = [b.name for b in layers.backends if b.cuda_graph_support == "none"]
    if unsupported:
        reasons.append(f"attention backend {', '.join(unsupported)} declares cuda_graph_support 'none'")
    if not layers.uniform:
        reasons.append("the model's layers attend in several ways")
    if config.parallel.tensor_parallel_size > 1:
        reasons.append("tensor parallelism runs each rank's forward eagerly (no per-rank graphs yet)")
    for option, why in (("kv_connector", "a KV connector"), ("speculative_config", "speculative decoding")):
        if getattr(config, option):
            reasons.append(f"{why} is configured")
    if runner_kind == "pooling":
        reasons.append("the pooling runner samples nothing to decode")
    sizes = capture_sizes(config.cuda_graph_sizes, config.scheduler.max_num_seqs)
    if not sizes:
        reasons.append(f"cuda_graph_sizes leaves no size up to max_num_seqs {config.scheduler.max_num_seqs}")
    return (() if reasons else sizes), reasons


def graph_memory_estimate(sizes: Sequence[int], hf_config, dtype: torch.dtype) -> int:
    """Bytes the graphs hold: their shared pool (the largest bucket's activations: a few
    [B, hidden] and [B, intermediate] buffers live at once, sized generously) and each graph's
    own overhead. Logits are computed outside the graphs."""
    if not sizes:
        return 0
    hidden = getattr(hf_config, "hidden_size", 0)
    intermediate = getattr(hf_config, "intermediate_size", 4 * hidden)
    return max(sizes) * (8 * hidden + 4 * intermediate) * dtype.itemsize + GRAPH_OVERHEAD_BYTES * len(sizes)


def start(model, attention, kv_caches, sizes: tuple[int, ...], reasons: list[str], max_blocks: int,
          platform) -> CudaGraphRunner | None:
    """The captured graphs for ``sizes`` (from :func:`graph_plan`), or None (decode runs
    eagerly; the reasons are logged where graphs could have been expected, and a capture that
    fails — a forward that syncs with the host cannot be captured — falls back to eager)."""
    if not sizes:
        log = logger.info if platform.device_type == "cuda" else logger.debug
        log("decode steps run eagerly: %s", "; ".join(reasons))
        return None
    runner = CudaGraphRunner(model, attention, kv_caches, sizes, max_blocks, platform.device)
    try:
        runner.capture()
    except RuntimeError as exc:  # e.g. a model whose forward syncs with the host (MoE routing counts)
        logger.warning("decode steps run eagerly: capturing a CUDA graph failed: %s", exc)
        return None
    return runner


@attrs.frozen
class CapturedDecode:
    graph: object  # torch.cuda.CUDAGraph
    inputs: DecodeInputs  # the static buffers it reads
    hidden: torch.Tensor  # the static output it writes, [size, hidden]


class CudaGraphRunner:
    """The model's decode forward captured per bucket; ``replay`` runs a step through one, or
    returns None for the caller to run it eagerly."""

    def __init__(self, model, attention, kv_caches: list[torch.Tensor], sizes: tuple[int, ...], max_blocks: int,
                 device: torch.device):
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.sizes, self.max_blocks, self.device = sizes, max_blocks, device
        self.graphs: dict[int, CapturedDecode] = {}
        self._pool = None

    @torch.inference_mode()
    def capture(self) -> None:
        for size in sorted(self.sizes, reverse=True):  # the largest first: the smaller fit its pool
            inputs = DecodeInputs.empty(size, self.max_blocks, self.device)
            step = StepContext(self.attention, self.attention.build_metadata(inputs.layout), self.kv_caches,
                               (), [], ())

            def forward(inputs=inputs, step=step):
                return self.model(inputs.input_ids, inputs.positions, step)

            forward()  # warm-up: kernels compiled, allocator settled
            graph, hidden = self.record(forward)
            self.graphs[size] = CapturedDecode(graph, inputs, hidden)
        logger.info("captured %d CUDA graphs for decode batches of %s", len(self.sizes), ", ".join(map(str, self.sizes)))

    def record(self, forward):
        """(a CUDA graph of ``forward``, the output tensor it writes), every graph in one pool."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = forward()
        torch.cuda.synchronize()
        return graph, hidden

    def replay(self, batch) -> torch.Tensor | None:
        """The hidden states of ``batch`` (the runner's ``StepInput``) through a
        captured graph, or None when it is not a uniform decode step that a bucket holds."""
        if not is_uniform_decode(batch.layouts):
            return None
        size = bucket_for(batch.layout.num_requests, self.sizes)
        if size is None or batch.layout.block_table.shape[1] > self.max_blocks:
            return None
        captured = self.graphs[size]
        captured.inputs.copy_(pad_decode(batch.input_ids, batch.positions, batch.layout, size, self.max_blocks))
        captured.graph.replay()
        return captured.hidden[:batch.layout.num_requests]
