"""Weights from a trainer over ``torch.distributed`` (SGLang's ``init_weights_update_group`` and
``update_weights_from_distributed``; vLLM's RLHF examples do the same through
``collective_rpc``): the trainer is rank 0 of a group of its own, hosts the group's TCP store,
and broadcasts tensors under their checkpoint names; the engine joins as ``rank_offset``.

Under tensor parallelism every rank of the engine joins, tensor-parallel rank ``r`` as
``rank_offset + r`` (vLLM's RLHF examples and SGLang alike), so ``world_size`` is at least
``rank_offset + tensor_parallel_size`` (1 + 2 = 3 for a trainer beside a TP=2 engine). The
trainer broadcasts each tensor whole, once; every rank receives it and keeps its own share, cut
as loading cuts a checkpoint's (its parallel layers narrow the whole tensor).

The group is plain ``torch.distributed``, so a trainer needs nothing of this engine::

    store = torch.distributed.TCPStore(host, port, world_size, is_master=True)
    group = torch.distributed.ProcessGroupGloo(
        torch.distributed.PrefixStore(group_name, store), 0, world_size, timeout
    )
    group.broadcast(tensor, 0).wait()  # each tensor, in the order the update names them

The tensors received replace the checkpoint's of the same names, and the model is built from the
result as the served one is (:class:`UpdatedLoader`), so a quant method that quantizes at load
quantizes them too and a fused or repacked layer gets exactly what loading would give it."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from engine.interfaces import ModelLoader

BACKENDS = ("gloo",)


def check_place(backend: str, rank_offset: int, world_size: int, ranks: int) -> None:
    """Refuse a group the engine's ``ranks`` (its tensor-parallel ranks, ``rank_offset`` on) cannot
    join, before any rank tries."""
    if backend not in BACKENDS:
        raise ValueError(f"init_weights_update_group: backend {backend!r}; the CPU engine joins {BACKENDS}")
    if rank_offset < 1 or rank_offset + ranks > world_size:
        held = f"ranks {rank_offset}..{rank_offset + ranks - 1}" if ranks > 1 else f"rank {rank_offset}"
        raise ValueError(
            f"init_weights_update_group: rank_offset {rank_offset} must be at least 1 and the engine's "
            f"{held} must lie below world_size={world_size}: the trainer is rank 0, each "
            "tensor-parallel rank of the engine one more"
        )


class WeightUpdateGroup:
    """One engine rank's end of a trainer's group: rank ``rank`` of ``world_size`` (checked by
    :func:`check_place` first)."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout: datetime.timedelta,
    ):
        try:
            store = dist.TCPStore(master_address, int(master_port), world_size, False, timeout=timeout)
            self.group = dist.ProcessGroupGloo(dist.PrefixStore(group_name, store), rank, world_size, timeout)
        except (RuntimeError, OSError, ValueError) as exc:
            raise ValueError(
                f"init_weights_update_group: could not join {group_name!r} at {master_address}:{master_port} "
                f"as rank {rank} of {world_size}: {exc}"
            ) from None
        self.timeout = timeout

    def receive(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> dict[str, torch.Tensor]:
        """The tensors the trainer broadcasts, one per name, in order."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("update_weights_from_distributed: names, dtypes and shapes differ in length")
        received = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty([int(n) for n in shape], dtype=_dtype(dtype))
            self.group.broadcast(tensor, 0).wait(self.timeout)
            received[name] = tensor
        return received


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"update_weights_from_distributed: {name!r} is not a floating-point torch dtype")
    return dtype


class UpdatedLoader(ModelLoader):
    """The checkpoint ``base`` reads, with ``tensors`` in place of its tensors of the same names.
    A name the checkpoint lacks is refused (nothing is loaded): a trainer's weights must fit."""

    name = "updated"

    def __init__(self, base: ModelLoader, tensors: dict[str, torch.Tensor]):
        super().__init__(base.path)
        self.base, self.tensors = base, tensors

    @classmethod
    def detect(cls, path: str) -> list[str]:
        return ["built by weight updates only"]

    def hf_config(self) -> Any:
        return self.base.hf_config()

    def tokenizer(self) -> Any | None:
        return self.base.tokenizer()

    def quant_config(self) -> dict | None:
        return self.base.quant_config()

    def iter_weights(self, hf_config: Any, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors, the trainer's in place of theirs; raises once the checkpoint
        is read if a name was not among them (the model being built is then thrown away)."""
        return self._replaced(self.base.iter_weights(hf_config, keep_quantized))

    def iter_weight_slices(self, hf_config: Any, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
        """A tensor-parallel rank's: the checkpoint's slices, the trainer's whole tensors in place
        of theirs (a parallel layer keeps its rank's part of a whole tensor as of a slice)."""
        return self._replaced(self.base.iter_weight_slices(hf_config))

    def _replaced(self, weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        unknown = set(self.tensors)
        for name, tensor in weights:
            unknown.discard(name)
            yield name, self.tensors.get(name, tensor)
        if unknown:
            first = min(unknown)
            more = f" (and {len(unknown) - 1} more names)" if len(unknown) > 1 else ""
            raise ValueError(f"update_weights_from_distributed: the checkpoint has no tensor {first!r}{more}")
