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
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator

import torch
from torch import nn

LEVELS = (1, 2)


class SleepMode:
    """``rebuild(path, tensors)``: a fresh model from the checkpoint at ``path``, ``tensors`` (checkpoint
    name -> tensor) in place of its own, built as the served one."""

    def __init__(self, platform, model: nn.Module, kv_caches: list[torch.Tensor], rebuild: Callable, path):
        self.platform, self.model, self.kv_caches = platform, model, kv_caches
        self.rebuild = rebuild
        self.checkpoint = path
        self.received: dict[str, torch.Tensor] = {}  # a trainer's tensors since the checkpoint's
        self.level = 0  # 0: awake
        self._stash = None  # the weights' bytes while asleep at level 1, in storage order
        self._discarded = False  # the weights were released without a copy (level 2)

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
            self._copy_in(self.rebuild(self.checkpoint, self.received), "the weights")
            self._discarded = False
        self.level = 0

    def load(self, path: str) -> None:
        """Copy the weights of the checkpoint at ``path`` into the served model, in place
        (asleep too: waking then keeps them)."""
        self._copy_in(self.rebuild(path, {}), f"weights at {path}")
        self.checkpoint, self.received = path, {}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Serve the checkpoint with ``tensors`` (and those sent before) in place of its own."""
        received = {**self.received, **tensors}
        self._copy_in(self.rebuild(self.checkpoint, received), "the trainer's weights")
        self.received = received

    def _copy_in(self, model: nn.Module, what: str) -> None:
        fresh = dict(named_tensors(model))
        served = dict(named_tensors(self.model))
        for name, tensor in fresh.items():
            old = served.get(name)
            if old is None or old.shape != tensor.shape or old.dtype != tensor.dtype:
                found = "missing" if old is None else f"{tuple(old.shape)} {old.dtype}"
                raise ValueError(
                    f"{what} do not fit the served model: {name} is "
                    f"{tuple(tensor.shape)} {tensor.dtype} there, {found} here"
                )
        with torch.no_grad():
            for name, tensor in fresh.items():
                served[name].copy_(tensor)
        self._drop_stash()
        self._discarded = False

    def _drop_stash(self) -> None:
        if self._stash is not None:
            self._stash.close()
            self._stash = None


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
    """The distinct storages under ``tensors`` (views share one), in a stable order."""
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
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
