"""Checkpoint tensors read lazily: a tensor-parallel rank reads only its part of each weight.

A model loader's ``iter_weight_slices`` yields, per name, either a torch tensor or a
:class:`CheckpointSlice`: ``shape`` without reading, ``narrow(dim, start, length)`` reading
only that part, ``full()`` reading all of it. Layers take their rank's part with ``narrow``
(:meth:`engine.layers.Linear.rank_part`); everything else is read whole with :func:`materialize`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class CheckpointSlice(ABC):
    """One checkpoint tensor, not read yet."""

    @property
    @abstractmethod
    def shape(self) -> tuple[int, ...]:
        """The stored tensor's shape."""

    @abstractmethod
    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read ``length`` entries of dimension ``dim`` from ``start`` (only those bytes)."""

    @abstractmethod
    def full(self) -> torch.Tensor:
        """Read the whole tensor."""


def materialize(tensor) -> torch.Tensor:
    """A torch tensor as it is; a :class:`CheckpointSlice` read whole."""
    return tensor.full() if isinstance(tensor, CheckpointSlice) else tensor


class RowRange(CheckpointSlice):
    """Rows [start, start + rows) of a lazy checkpoint tensor, still lazy: a fused projection's
    part (:func:`engine.layers.loading.split_fused`)."""

    def __init__(self, tensor: CheckpointSlice, start: int, rows: int):
        self.tensor, self.start, self.rows = tensor, start, rows

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.tensor.shape[1:])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self.tensor.narrow(0, self.start + start, length)
        return self.full().narrow(dim, start, length)

    def full(self) -> torch.Tensor:
        return self.tensor.narrow(0, self.start, self.rows)


def narrow_rows(tensor, start: int, rows: int):
    """Rows [start, start + rows) of a torch tensor, or of a :class:`CheckpointSlice` (lazily)."""
    return (
        RowRange(tensor, start, rows)
        if isinstance(tensor, CheckpointSlice)
        else tensor.narrow(0, start, rows)
    )
