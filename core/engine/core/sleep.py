"""Sleep mode and weight updates: what an RL trainer sharing the machine needs (vLLM's
``--enable-sleep-mode`` with ``/sleep?level=`` and ``/wake_up``; SGLang's
``update_weights_from_disk`` and ``update_weights_from_distributed``).

Memory is given back in place (:meth:`engine.interfaces.Platform.release_memory`): every
tensor keeps its address, so the recorded step graphs, the runner and the KV connector keep
their references and nothing is rebuilt on waking.

- Level 1: the KV cache is released (its prefix cache forgotten) and the weights are written to
  an unlinked temporary file (``TMPDIR``) before theirs is released; waking reads them back.
- Level 2: the weights are discarded too; waking reads them from the checkpoint (the one the
  engine started with, or the last ``update_weights_from_disk``) with the tensors a trainer sent
  since (kept for this, as the trainer sent them).

A weight update builds the new weights' model like the served one — from a checkpoint, or from
the served checkpoint with a trainer's tensors in place of its own (:mod:`engine.core.weight_sync`)
— checks that every tensor matches in name, shape and dtype (nothing changes otherwise), copies
them in place and forgets the prefix cache, whose blocks the old weights computed.

Under tensor parallelism each rank holds a :class:`SleepMode` of its own and every call runs on
all of them together (:meth:`engine.interfaces.Executor.sleep_mode_call`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator

import torch
from torch import nn

from engine.core.weight_sync import WeightUpdateGroup

LEVELS = (1, 2)


class SleepMode:
    """One rank's sleep mode and weight updates; under tensor parallelism every rank has its own
    (its model's share, its KV caches) and the executor runs each call on all of them at once
    (:meth:`engine.interfaces.Executor.sleep_mode_call`). ``rebuild(path, tensors)``: this rank's
    share of a fresh model from the checkpoint at ``path``, ``tensors`` (checkpoint name -> full
    tensor) in place of its own, built as the served one. ``rank``: this rank's place in the
    tensor-parallel group (its rank in a trainer's group is ``rank_offset + rank``).

    A weight update has two steps so that the ranks change together or not at all: each rank
    builds and checks the new weights (:meth:`prepare_checkpoint`, :meth:`receive`), and only
    when every rank succeeded does each copy them in (:meth:`commit`; else :meth:`abort`)."""

    def __init__(
        self, platform, model: nn.Module, kv_caches: list[torch.Tensor], rebuild: Callable, path, rank=0
    ):
        self.platform, self.model, self.kv_caches = platform, model, kv_caches
        self.rebuild, self.rank = rebuild, rank
        self.checkpoint = path
        self.received: dict[str, torch.Tensor] = {}  # a trainer's tensors since the checkpoint's
        self.level = 0  # 0: awake
        self._stash = None  # the weights' bytes while asleep at level 1, in storage order
        self._discarded = False  # the weights were released without a copy (level 2)
        self._prepared: tuple[nn.Module, str, dict] | None = None  # (model, checkpoint, received)
        self.group: WeightUpdateGroup | None = None  # a trainer's, once joined

    def sleep(self, level: int) -> int:
        """Release the KV cache, and the weights as ``level`` says; returns the bytes released.
        Asleep already, a deeper level discards the weights' copy; a shallower one does nothing."""
        if level not in LEVELS:
            raise ValueError(f"sleep level must be one of {LEVELS}, not {level!r}")
        if self.level >= level:
            return 0
        weights = _storages(t for _, t in named_tensors(self.model))
        if level == 1:
            self._stash = _write(weights)
        else:
            self._drop_stash()
            self._discarded = True
        released = self.platform.release_memory(weights)
        if not self.level:
            released += self.platform.release_memory(_storages(self.kv_caches))
        self.level = level
        return released

    def wake_up(self) -> None:
        if self._stash is not None:
            _read(self._stash, _storages(t for _, t in named_tensors(self.model)))
            self._drop_stash()
        elif self._discarded:
            self._copy_in(self.rebuild(self.checkpoint, self.received))
            self._discarded = False
        self.level = 0

    def prepare_checkpoint(self, path: str) -> None:
        """Build this rank's share of the checkpoint at ``path`` and check that it fits the served
        model (raises naming the first tensor that does not); :meth:`commit` serves it."""
        self._prepare(path, {}, f"weights at {path}")

    def join_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int, *rest):
        """Join a trainer's group as rank ``rank_offset + self.rank`` (``rest``: group name,
        backend, timeout, as :class:`WeightUpdateGroup` takes them)."""
        if self.group is not None:
            raise ValueError("init_weights_update_group: a group is open; destroy_weights_update_group first")
        self.group = WeightUpdateGroup(
            master_address, master_port, rank_offset + self.rank, world_size, *rest
        )

    def leave_group(self) -> None:
        self.group = None

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        """Receive ``names`` (whole tensors) from the trainer's broadcasts and build this rank's
        share of the served checkpoint with them and those sent before in place of its own;
        :meth:`commit` serves it."""
        if self.group is None:
            raise ValueError("update_weights_from_distributed: no group; init_weights_update_group first")
        received = {**self.received, **self.group.receive(names, dtypes, shapes)}
        self._prepare(self.checkpoint, received, "the trainer's weights")

    def commit(self) -> None:
        """Serve the prepared weights (asleep too: waking then keeps them)."""
        if self._prepared is None:
            raise RuntimeError("commit: no weights were prepared")
        model, self.checkpoint, self.received = self._prepared
        self._prepared = None
        self._copy_in(model)

    def abort(self) -> None:
        self._prepared = None

    def _prepare(self, path: str, received: dict[str, torch.Tensor], what: str) -> None:
        self._prepared = None
        model = self.rebuild(path, received)
        _check_fits(dict(named_tensors(model)), dict(named_tensors(self.model)), what)
        self._prepared = (model, path, received)

    def _copy_in(self, model: nn.Module) -> None:
        served = dict(named_tensors(self.model))
        with torch.no_grad():
            for name, tensor in named_tensors(model):
                served[name].copy_(tensor)
        self._drop_stash()
        self._discarded = False

    def _drop_stash(self) -> None:
        if self._stash is not None:
            self._stash.close()
            self._stash = None


def _check_fits(fresh: dict[str, torch.Tensor], served: dict[str, torch.Tensor], what: str) -> None:
    for name, tensor in fresh.items():
        old = served.get(name)
        if old is None or old.shape != tensor.shape or old.dtype != tensor.dtype:
            found = "missing" if old is None else f"{tuple(old.shape)} {old.dtype}"
            raise ValueError(
                f"{what} do not fit the served model: {name} is "
                f"{tuple(tensor.shape)} {tensor.dtype} there, {found} here"
            )


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a model holds: parameters, buffers, and tensor attributes of its modules
    (weights a kernel repacked at load are often kept so), each once."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        owned = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        owned += [(k, v) for k, v in vars(module).items() if isinstance(v, torch.Tensor)]
        for name, tensor in owned:
            if id(tensor) not in seen and tensor.numel():
                seen.add(id(tensor))
                yield (f"{prefix}.{name}" if prefix else name), tensor


def _storages(tensors) -> list[torch.UntypedStorage]:
    """The distinct storages under ``tensors`` (views share one), in a stable order. Opaque
    tensors (oneDNN's prepacked weights, on CPUs that compute bfloat16) have none to release:
    they stay resident while asleep, and a reload copies into them."""
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        if tensor.is_mkldnn:
            continue
        storage = tensor.untyped_storage()
        found.setdefault(storage.data_ptr(), storage)
    return [found[ptr] for ptr in sorted(found)]


def _bytes(storage: torch.UntypedStorage):
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


def _write(storages: list[torch.UntypedStorage]):
    stash = tempfile.TemporaryFile(prefix="engine-sleep-")  # noqa: SIM115 - open while asleep
    for storage in storages:
        stash.write(memoryview(_bytes(storage)))
    stash.flush()
    return stash


def _read(stash, storages: list[torch.UntypedStorage]) -> None:
    stash.seek(0)
    for storage in storages:
        view = memoryview(_bytes(storage))
        if stash.readinto(view) != len(view):
            raise RuntimeError("the sleeping engine's weights file was cut short")
