"""What the driver broadcasts for a drafter that drafts on every rank
(``Drafter.drafts_on_every_rank``): the call each rank runs on its own drafter, its arguments
and what rank 0 shares during it on host tensors. (Not in :mod:`engine.executors.worker`: the
``mp`` worker runs that module as ``__main__``, whose classes are not the ones unpickled.)"""

from __future__ import annotations

import attrs
import torch

from engine.interfaces import DraftRequest


@attrs.frozen
class DrafterCall:
    """Run ``drafter.<name>(*args)`` (rank 0 runs the same call on its drafter)."""

    name: str
    args: tuple


def on_device(value, device):
    """``value`` with the tensors in it (in draft requests, lists and tuples too) on ``device``:
    the broadcast carries host tensors, as :meth:`engine.runner.model_runner.StepInput.to`
    explains."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, DraftRequest) and value.hidden_states is not None:
        return attrs.evolve(value, hidden_states=value.hidden_states.to(device))
    if isinstance(value, list | tuple):
        return type(value)(on_device(v, device) for v in value)
    return value
