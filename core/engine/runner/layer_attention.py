"""Which attention backend and which KV cache group each layer of a model uses.

A model whose layers attend alike has one backend and one group. Per-layer attention kinds
(``KVLayout.layer_kinds``: Gemma's sliding-window and global layers) get one backend per
distinct kind; layers with a sliding window keep their KV in a group of their own, whose block
tables drop the blocks a window no longer reaches. Each step the runner builds one
:class:`~engine.interfaces.BatchLayout` per group and each backend's metadata once per group it
serves, shared by all its layers.

Layers holding fixed-size per-request state (``AttentionKind.state``: Mamba2 mixers) attend
nothing; :class:`StateSlots` stands where their backend would, so the pool's sizing, allocation
and each step's metadata take them like any layer. They sit in a state group of their own whose
"block" spans a whole sequence (vLLM sizes the Mamba group's block at the model's length): a
request holds one, its slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from engine.interfaces import AttentionBackend, AttentionSpec, BatchLayout, MambaState, Platform

# the tokens a state group's block spans: more than any sequence, so a request holds one block
WHOLE_SEQUENCE = 2**30


class StateSlots(AttentionBackend):
    """The cache layout of layers that keep a :class:`MambaState` per request: each layer's
    tensor is [slots, state.elements] float32 (slot 0 the null block), and a step's metadata is
    its state group's :class:`BatchLayout` — a request's slot is ``block_table[b, 0]``, and one
    whose context starts this step (``seq_lens_host[b] == query_lens[b]``) starts from zero
    state. The model's mixer reads it (``LayerOps.causal_conv1d``, ``LayerOps.ssm_scan``)."""

    name = "mamba-state"
    block_dim = 0

    def __init__(self, state: MambaState, platform: Platform):
        spec = AttentionSpec(state.num_heads, state.num_heads, state.head_dim, torch.float32, WHOLE_SEQUENCE)
        super().__init__(spec, platform)
        self.state = state

    @classmethod
    def supports(cls, spec: AttentionSpec, platform: Platform) -> list[str]:
        return []

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.state.elements)

    def forward(self, query, key, value, kv_cache, metadata) -> torch.Tensor:
        raise TypeError("a state layer attends nothing: its mixer reads the state slots")


@attrs.frozen
class LayerAttention:
    backends: tuple[AttentionBackend, ...]  # one per distinct attention kind
    layer_backend: tuple[int, ...]  # per layer: index into ``backends``
    layer_group: tuple[int, ...]  # per layer: its KV cache group (index into a step's layouts)

    @property
    def first(self) -> AttentionBackend:
        """The first attending layer's backend (what a caller that knows one backend gets);
        a model of state layers only (Mamba2) gets its :class:`StateSlots`."""
        attending = [b for b in self.backends if not isinstance(b, StateSlots)]
        return attending[0] if attending else self.backends[0]

    @property
    def chunk_invariant(self) -> bool:
        """Whether every backend declares ``chunk_invariant`` (a row's attention is the same in
        any chunk, from cached blocks or not)."""
        return all(backend.chunk_invariant for backend in self.backends)

    @property
    def has_state(self) -> bool:
        """Whether some layers keep per-request state (Mamba2 mixers) rather than pages."""
        return any(isinstance(backend, StateSlots) for backend in self.backends)

    def group_block_sizes(self, block_size: int) -> tuple[int, ...]:
        """Each KV cache group's tokens per block: ``block_size`` for pages, a whole sequence
        for a state group."""
        sizes = dict.fromkeys(range(max(self.layer_group) + 1), block_size)
        for backend, group in zip(self.layer_backend, self.layer_group):
            if isinstance(self.backends[backend], StateSlots):
                sizes[group] = WHOLE_SEQUENCE
        return tuple(sizes.values())

    @property
    def uniform(self) -> bool:
        return len(self.backends) == 1 and not any(self.layer_group)

    def step_layers(self, layouts: Sequence[BatchLayout]) -> tuple[tuple[AttentionBackend, object], ...]:
        """Each layer's (backend, metadata) for a step whose groups have ``layouts``."""
        built: dict[tuple[int, int], object] = {}
        out = []
        for backend, group in zip(self.layer_backend, self.layer_group):
            if (backend, group) not in built:
                built[backend, group] = self.backends[backend].build_metadata(layouts[group])
            out.append((self.backends[backend], built[backend, group]))
        return tuple(out)
