"""Checking an attention backend's ``cuda_graph_support = "decode-only"`` without a GPU.

:func:`replayed_tokens` runs the engine's step-graph runner with the recording replaced by a
CPU stand-in (:class:`RerunGraphs`): replaying reruns the recorded forward over the same static
buffers, through the metadata the backend built for them once at capture
(``build_graph_metadata``), into the same output tensor — what a graph's kernels do. A backend
whose metadata does not survive its layout's tensors being overwritten in place gives other
tokens under it than eagerly (:func:`replayed_tokens` against a plain ``generate``). Only the
recording is emulated: that the backend's forward launches no host sync and allocates nothing
outside a capture is for a device to show."""

from __future__ import annotations

from engine.interfaces import StepGraphs
from engine.runner.step_graphs import GraphPlan, StepGraphRunner


class Replayed:
    """Stands in for a CUDA graph: ``replay`` reruns ``forward`` into the tensor it first returned."""

    def __init__(self, forward):
        self.forward, self.hidden, self.replays = forward, forward(), 0

    def replay(self) -> None:
        self.hidden.copy_(self.forward())
        self.replays += 1


class RerunGraphs(StepGraphs):
    """Step graphs that record by keeping the forward to rerun."""

    name = "rerun forwards"

    def record(self, forward):
        graph = Replayed(forward)
        return graph, graph.hidden


def replayed_tokens(llm, prompts, params, sizes: tuple[int, ...]):
    """Token ids of ``llm.generate(prompts, params)`` with its decode steps replayed from
    buckets of ``sizes``, and how often each bucket replayed (its forward's recording and its
    greedy one together)."""
    runner, config = llm.engine.runner, llm.engine.config
    max_blocks = -(-llm.engine.max_model_len // config.cache.block_size)
    graphs = StepGraphRunner(
        llm.engine.model,
        runner.attention,
        runner.kv_caches,
        GraphPlan(RerunGraphs(), sizes, ()),
        max_blocks,
        runner.device,
        llm.engine.hf_config.vocab_size,
        llm.engine.max_model_len,
    )
    graphs.capture(check=False)  # what an unchecked recording replays
    runner.graphs = graphs
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        runner.graphs = None
    counts = {}
    for size in sizes:
        recorded = graphs.graphs[size]
        both = [g for g in (recorded.graph, recorded.greedy) if isinstance(g, Replayed)]
        if both:
            counts[size] = sum(g.replays for g in both)
    return tokens, counts
