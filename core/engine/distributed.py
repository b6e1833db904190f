"""Tensor-parallel process groups: the rank a layer is built for and the collectives it calls.

A :class:`TensorParallel` is process topology, not step state: the engine builds a model
inside ``with tensor_parallel(group):`` and each parallel layer keeps the group it was built
with (so a TP=1 engine and a TP=2 driver can live in one process). Outside that block every
layer is built for one rank. Collectives go through the :class:`Communicator` the platform
provides (``Platform.communicator``); a collective that fails or times out raises
:class:`CollectiveFailure`, which the engine treats as fatal (a peer is gone or stuck).

:class:`ProcessGroupCommunicator` is the default communicator: a ``torch.distributed``
process group of the platform's ``dist_backend`` (gloo on CPU, NCCL on CUDA), built
directly on a ``TCPStore`` rather than as the process-wide default group, so several engines
can run in one process and every wait has its own timeout.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import pickle
from abc import ABC, abstractmethod
from collections.abc import Iterator

import attrs
import torch
import torch.distributed as dist


class ExecutorFailure(RuntimeError):
    """The executor's ranks can no longer step together; fatal for the engine."""


class Communicator(ABC):
    """The collectives of one tensor-parallel group, as its parallel layers call them. Each
    call blocks until done and raises (never hangs) once the group's timeout passes."""

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``x`` over the ranks, on every rank (may reuse ``x``)."""

    @abstractmethod
    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the ranks' ``x`` concatenated along the last dim, rank order; others: None."""


class CollectiveFailure(ExecutorFailure):
    """A collective failed or timed out: a peer died, or is stuck."""


@attrs.frozen
class TensorParallel:
    """This process's place in the tensor-parallel group: ``rank`` of ``size``."""

    rank: int = 0
    size: int = 1
    communicator: Communicator | None = None

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's even share of ``total``."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size: {what} ({total}) is not divisible by {self.size}")
        share = total // self.size
        return self.rank * share, share

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (in place where the communicator can)."""
        if self.size == 1:
            return x
        return self._collective("all_reduce", x)

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise max of ``x`` over the ranks, exact: each rank's ``x`` in its own
        slot of zeros, summed (an all-gather on the communicator's one reduction), maxed.
        For load time (a quant method's scales), not for every step."""
        if self.size == 1:
            return x
        slots = x.new_zeros(self.size, *x.shape)
        slots[self.rank] = x
        return self.all_reduce(slots).amax(dim=0)

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along the last dim, on rank 0; None elsewhere."""
        if self.size == 1:
            return x
        return self._collective("gather", x)

    def _collective(self, name: str, x: torch.Tensor):
        try:
            return getattr(self.communicator, name)(x)
        except Exception as exc:
            raise CollectiveFailure(
                f"tensor-parallel {name} failed on rank {self.rank} of {self.size}: {exc}"
            ) from exc


SINGLE = TensorParallel()
_BUILDING: contextvars.ContextVar[TensorParallel] = contextvars.ContextVar("tensor_parallel", default=SINGLE)


@contextlib.contextmanager
def tensor_parallel(group: TensorParallel) -> Iterator[TensorParallel]:
    """Layers constructed inside this block are built for ``group``."""
    token = _BUILDING.set(group)
    try:
        yield group
    finally:
        _BUILDING.reset(token)


def current_tensor_parallel() -> TensorParallel:
    """The group layers being constructed now are for (one rank outside ``tensor_parallel``)."""
    return _BUILDING.get()


@attrs.frozen
class GroupAddress:
    """Where the ranks of one group meet: the driver's ``TCPStore`` and a name for the group."""

    host: str
    port: int
    world_size: int
    timeout_s: float
    prefix: str = "tp"

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)


def open_store(address: GroupAddress, rank: int) -> dist.Store:
    """The group's store; rank 0 hosts it (port 0 on the driver: pick a free one)."""
    return dist.TCPStore(
        address.host,
        address.port,
        address.world_size,
        rank == 0,
        timeout=address.timeout,
        wait_for_workers=False,
    )


def process_group(backend: str, store: dist.Store, rank: int, address: GroupAddress, name: str):
    """A ``torch.distributed`` process group of ``backend`` on its own prefix of ``store``."""
    prefixed = dist.PrefixStore(f"{address.prefix}/{name}", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, address.world_size, address.timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = address.timeout
        return dist.ProcessGroupNCCL(prefixed, rank, address.world_size, options)
    raise ValueError(
        f"distributed backend {backend!r}: the default communicator knows gloo and nccl; "
        "a platform with another backend overrides Platform.communicator"
    )


class ProcessGroupCommunicator(Communicator):
    """All-reduce and gather over one ``torch.distributed`` process group, each wait bounded."""

    def __init__(self, group, rank: int, world_size: int, timeout: datetime.timedelta):
        self.group, self.rank, self.world_size, self.timeout = group, rank, world_size, timeout

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        self.group.allreduce([x]).wait(self.timeout)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        x = x.contiguous()
        outputs = [[torch.empty_like(x) for _ in range(self.world_size)]] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self.group.gather(outputs, [x], options).wait(self.timeout)
        return torch.cat(outputs[0], dim=-1) if self.rank == 0 else None


class ObjectChannel:
    """Broadcast of one picklable object from rank 0 over a gloo group (the executor's control
    plane: the step input each step). Two collectives: the payload's size, then its bytes.
    :meth:`gather` goes the other way: every rank's object to every rank (a control call's
    outcome on each rank)."""

    def __init__(self, group, rank: int, timeout: datetime.timedelta):
        self.group, self.rank, self.timeout = group, rank, timeout
        self.last_bytes = 0

    def send(self, obj) -> None:
        payload = _pickled(obj)
        self._broadcast(torch.tensor([payload.numel()], dtype=torch.int64))
        self._broadcast(payload)
        self.last_bytes = payload.numel()

    def receive(self):
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(payload)
        return pickle.loads(payload.numpy().tobytes())

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank (two all-gathers: the sizes, then
        the payloads padded to the longest)."""
        payload = _pickled(obj)
        sizes = self._all_gather(torch.tensor([payload.numel()], dtype=torch.int64))
        padded = torch.zeros(int(max(sizes).item()), dtype=torch.uint8)
        padded[: payload.numel()] = payload
        payloads = self._all_gather(padded)
        return [pickle.loads(p[: int(n.item())].numpy().tobytes()) for p, n in zip(payloads, sizes)]

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        outputs = [[torch.empty_like(tensor) for _ in range(self.group.size())]]
        try:
            self.group.allgather(outputs, [tensor]).wait(self.timeout)
        except Exception as exc:
            raise CollectiveFailure(f"control gather failed on rank {self.rank}: {exc}") from exc
        return outputs[0]

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            self.group.broadcast([tensor], options).wait(self.timeout)
        except Exception as exc:
            raise CollectiveFailure(f"step broadcast failed on rank {self.rank}: {exc}") from exc


def _pickled(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
