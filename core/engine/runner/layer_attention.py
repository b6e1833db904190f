"""Which attention backend and which KV cache group each layer of a model uses.

A model whose layers attend alike has one backend and one group. Per-layer attention kinds
(``KVLayout.layer_kinds``: Gemma's sliding-window and global layers) get one backend per
distinct kind; layers with a sliding window keep their KV in a group of their own, whose block
tables drop the blocks a window no longer reaches. Each step the runner builds one
:class:`~engine.interfaces.BatchLayout` per group and each backend's metadata once per group it
serves, shared by all its layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from engine.interfaces import AttentionBackend, BatchLayout


@attrs.frozen
class LayerAttention:
    backends: tuple[AttentionBackend, ...]  # one per distinct attention kind
    layer_backend: tuple[int, ...]  # per layer: index into ``backends``
    layer_group: tuple[int, ...]  # per layer: its KV cache group (index into a step's layouts)

    @property
    def first(self) -> AttentionBackend:
        """Layer 0's backend (what a caller that knows one backend gets)."""
        return self.backends[self.layer_backend[0]]

    @property
    def chunk_invariant(self) -> bool:
        """Whether every backend declares ``chunk_invariant`` (a row's attention is the same in
        any chunk, from cached blocks or not)."""
        return all(backend.chunk_invariant for backend in self.backends)

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
