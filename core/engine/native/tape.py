"""Native tapes: a decode step's C kernel calls recorded once and replayed by one C call.

At batch 1 a decoded token of a 30-layer model makes ~300 kernel calls through Python (module
calls, argument checks, ``data_ptr``, ctypes conversions): on the CPU that costs as much as a
third of the step. A platform whose decode forward is made of C kernels alone records it once per
batch size over static buffers, as the cuda platform captures a CUDA graph, and replays it with
:func:`Tape.replay` — one ctypes call, every kernel called from C with the arguments it got at
capture (``tape.c``).

A kernel is recordable when it is bound with :func:`bind` (what the cpu-native platform and
attention plugins do), with the types of its library's prototype header
(:mod:`engine.native.prototypes`): the binding records a call whenever a :func:`recording` is
active, and otherwise costs one attribute check. While recording, every torch op the forward dispatches is
watched: an op that computes (anything but an allocation or a view whose results share its input's
memory — ``Tensor.float()`` of a bf16 tensor is a copy) is work a replay would skip,
so the capture fails naming it (:class:`CaptureError`) and the engine keeps running eagerly; the
tensors the forward allocates are kept alive with the tape, whose kernels hold their addresses,
or, given an arena (:class:`TapeGraphs` gives its own), moved into it by liveness
(:mod:`engine.native.arena`).
A kernel whose result steers Python (an ``int64_t`` count or flag, rather than an
``engine_status``) cannot be recorded either: the branch taken at capture would be replayed for
every input.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import struct
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from engine.interfaces import StepGraphs
from engine.native import BuildError, Library, Prototype, load_source
from engine.native.arena import Arena
from engine.native.arena import plan as arena_plan

SOURCE = Path(__file__).with_name("tape.c")
logger = logging.getLogger(__name__)
# calling conventions under which tape.c's one prototype passes every kernel its arguments
ABIS = {("Linux", "x86_64"), ("Linux", "aarch64")}
MAX_INTS, MAX_FLOATS = 24, 8
_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default,
}


class CaptureError(RuntimeError):
    """A forward could not be recorded onto a tape (it says why)."""


class ReplayError(RuntimeError):
    """A recorded kernel refused its input on replay (its status was non-zero)."""


def unavailable_reasons() -> list[str]:
    """Why tapes cannot run in this process; empty when they can."""
    where = (platform.system(), platform.machine())
    if where not in ABIS:
        return [f"native tapes need the System V x86-64 or AArch64 calling convention, not {where}"]
    try:
        _library()
    except (OSError, RuntimeError) as error:
        return [f"cannot build the tape interpreter: {error}"]
    return []


class _Op(ctypes.Structure):
    _fields_ = [
        ("fn", ctypes.c_int64),
        ("checked", ctypes.c_int64),
        ("ints", ctypes.c_int64 * MAX_INTS),
        ("floats", ctypes.c_float * MAX_FLOATS),
    ]


@functools.cache
def _library():
    library = load_source(SOURCE)
    layout = library.tape_op_bytes(), library.tape_max_ints(), library.tape_max_floats()
    if layout != (ctypes.sizeof(_Op), MAX_INTS, MAX_FLOATS):
        raise RuntimeError("tape.c's op layout differs from tape.py's")
    return library


class NativeKernel:
    """A C entry point with its prototype's ctypes types, called like the ctypes function. One
    whose result is an ``engine_status`` (``status``) is checked on replay too; one with an
    ``int64_t`` result runs eagerly but cannot be taped."""

    __slots__ = ("_floats", "_pointers", "_unrecordable", "address", "function", "name", "status")

    def __init__(self, function, prototype: Prototype):
        self.name, self.function, self.status = prototype.name, function, prototype.status
        self.address = ctypes.cast(function, ctypes.c_void_p).value
        self._floats = tuple(type_ is ctypes.c_float for type_ in prototype.argtypes)
        integers = [type_ for type_ in prototype.argtypes if type_ is not ctypes.c_float]
        self._pointers = tuple(slot for slot, type_ in enumerate(integers) if type_ is ctypes.c_void_p)
        self._unrecordable = self._unrecordable_reason(prototype)

    def _unrecordable_reason(self, prototype: Prototype) -> str | None:
        if prototype.restype is not None and not prototype.status:
            return f"kernel {self.name} returns a value Python acts on"
        ints, floats = sum(not f for f in self._floats), sum(self._floats)
        if ints > MAX_INTS or floats > MAX_FLOATS:
            return f"kernel {self.name} takes more than {MAX_INTS} integer or {MAX_FLOATS} float arguments"
        return None

    def __call__(self, *args):
        if _recording is not None:
            _recording.add(self, args)
        return self.function(*args)

    def op(self, args) -> _Op:
        """This call as a tape op."""
        if self._unrecordable:
            raise CaptureError(self._unrecordable)
        if len(args) != len(self._floats):  # ctypes passes extra arguments on; a tape would drop them
            raise CaptureError(f"kernel {self.name} takes {len(self._floats)} arguments, not {len(args)}")
        op = _Op(self.address, int(self.status))
        ints = [_integer(a) for a, is_float in zip(args, self._floats) if not is_float]
        floats = [float(a) for a, is_float in zip(args, self._floats) if is_float]
        op.ints[: len(ints)], op.floats[: len(floats)] = ints, floats
        return op

    def pointers(self, op: _Op) -> list[tuple[int, int]]:
        """(integer slot, address) of each pointer argument of ``op``, one of this kernel's."""
        return [(slot, op.ints[slot]) for slot in self._pointers]


def _integer(value) -> int:
    if value is None:
        return 0
    if isinstance(value, ctypes._SimpleCData):
        value = value.value or 0
    return struct.unpack("<q", struct.pack("<Q", int(value) & (2**64 - 1)))[0]


def bind(library: Library, symbol: str) -> NativeKernel:
    """``library``'s ``symbol`` as a :class:`NativeKernel` (recordable onto tapes), typed by
    its prototype in the library's header."""
    return NativeKernel(getattr(library, symbol), library.prototypes[symbol])


def bind_source(source: Path, symbol: str, otherwise: str) -> NativeKernel | None:
    """``symbol`` of the library built from ``source`` (:func:`engine.native.load_source`),
    bound; None where it cannot be built here (no C compiler), logged with ``otherwise``: what
    runs in its place."""
    try:
        return bind(load_source(source), symbol)
    except BuildError as error:
        logger.info("%s: %s", otherwise, error)
        return None


class Tape:
    """Recorded kernel calls, replayed in order by one C call; holds the tensors they address,
    or lays those its forward allocated in an arena (:meth:`lay_out`)."""

    def __init__(self, calls: list[tuple[NativeKernel, tuple]], keep: list):
        self.names = [kernel.name for kernel, _ in calls]
        self._kernels = [kernel for kernel, _ in calls]
        self._ops = (_Op * len(calls))(*(kernel.op(args) for kernel, args in calls))
        self._keep = keep
        self._run = _library().tape_run
        self._arena: Arena | None = None
        self._generation, self._moves = -1, ()
        self._output: tuple[torch.Tensor, int] | None = None  # the forward's result, its arena offset
        self.arena_bytes = 0  # what its activations take of the arena

    def __len__(self) -> int:
        return len(self.names)

    def lay_out(self, arena: Arena, activations: Sequence[torch.Tensor], output: torch.Tensor) -> None:
        """Move ``activations`` (tensors the forward allocated; ``output``, what it returned,
        among them or not) into ``arena`` (:mod:`engine.native.arena`) and let them go: the
        kernels are re-pointed, ``output`` is set to its new place in the arena (which every
        replay of any tape of the arena may overwrite, as every replay of this one rewrites it)."""
        storages = {_storage(t): t.untyped_storage().nbytes() for t in activations}
        pointers = [kernel.pointers(op) for kernel, op in zip(self._kernels, self._ops)]
        layout = arena_plan(pointers, list(storages.items()), _storage(output))
        arena.reserve(layout.nbytes)
        self._arena, self._moves, self.arena_bytes = arena, layout.moves, layout.nbytes
        if _storage(output) in layout.offsets:
            offset = layout.offsets[_storage(output)] + output.data_ptr() - _storage(output)
            self._output = (output, offset)
        self._keep = [t for t in pytree.tree_leaves(self._keep) if _storage(t) not in storages]
        self._point_at_arena()

    def _point_at_arena(self) -> None:
        assert self._arena is not None
        base = self._arena.base
        for op, slot, offset in self._moves:
            self._ops[op].ints[slot] = base + offset
        if self._output is not None:
            output, offset = self._output
            at = offset // output.element_size()
            with torch.inference_mode(output.is_inference()):
                output.set_(self._arena.storage, at, output.shape, output.stride())
        self._generation = self._arena.generation

    def replay(self) -> None:
        if self._arena is not None and self._generation != self._arena.generation:
            self._point_at_arena()
        failed = self._run(ctypes.addressof(self._ops), len(self.names))
        if failed:
            raise ReplayError(f"kernel {self.names[failed - 1]} (op {failed} of the tape) refused its input")


class _Recording(TorchDispatchMode):
    """Collects kernel calls; watches torch ops: keeps what they return, notes what computes."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[NativeKernel, tuple]] = []
        self.keep: list = []
        self.allocated: list[torch.Tensor] = []
        self.computed: list[str] = []

    def add(self, kernel: NativeKernel, args: tuple) -> None:
        self.calls.append((kernel, args))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocated.append(out)
        elif not _only_aliases(func, out, (args, kwargs)) and str(func) not in self.computed:
            self.computed.append(str(func))
        self.keep.append(out)
        return out


def _only_aliases(func, out, inputs) -> bool:
    """Whether ``func`` did no work: a view op whose every result shares an input's storage. The
    schema's alias annotation alone is not enough: ``aten.to`` (what ``Tensor.float()``
    dispatches under inference mode) and ``reshape`` are annotated as views, yet copy when the
    dtype changes or the strides allow no view, and a tape would replay the kernels after them
    on the copy made at capture."""
    if not func.is_view:
        return False
    sources = {_storage(t) for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    return all(_storage(t) in sources for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


_recording: _Recording | None = None


@contextmanager
def recording():
    """Record the bound kernels called inside; yields the recording, whose ``tape()`` is the
    result. Not reentrant, one thread."""
    global _recording
    if _recording is not None:
        raise CaptureError("a tape is already recording")
    _recording = recorder = _Recording()
    try:
        with recorder:
            yield recorder
    finally:
        _recording = None


def record(forward: Callable[[], torch.Tensor], arena: Arena | None = None) -> tuple[Tape, torch.Tensor]:
    """(the tape of ``forward()``'s kernel calls, the tensor it returned — which every replay
    rewrites). With ``arena``, the activations the forward allocated are laid out in it
    (:meth:`Tape.lay_out`). Raises :class:`CaptureError` when the forward did work a tape cannot
    replay."""
    with recording() as recorder:
        out = forward()
    if recorder.computed:
        raise CaptureError(
            f"the forward computes with torch ops a tape cannot replay "
            f"({', '.join(recorder.computed[:4])}{' ...' if len(recorder.computed) > 4 else ''})"
        )
    if not recorder.calls:
        raise CaptureError("the forward called no native kernel")
    tape = Tape(recorder.calls, [*recorder.keep, out])
    if arena is not None:
        tape.lay_out(arena, recorder.allocated, out)
    return tape, out


def _storage(tensor) -> int | None:
    return tensor.untyped_storage().data_ptr() if isinstance(tensor, torch.Tensor) else None


class TapeGraphs(StepGraphs):
    """Decode steps recorded as native tapes, for a platform whose kernels are bound with
    :func:`bind`. By default every batch size up to ``max_num_seqs`` (at most 512): a tape saves
    the per-kernel Python cost at any size (10-25% of the default model's decode throughput at
    9-16 rows, 15% at 64), and a padded row costs real matmul work on a CPU (one 16-row tape
    for 9 rows was 8% slower than eager), so no size is padded. The tapes lay their activations
    in one arena (:mod:`engine.native.arena`: 2.6 MiB for 256 rows of the default model) and
    read their inputs from one set of buffers, so a size costs only its list of calls (~70 KiB
    on the default model). Sizes up to 8 are recorded at start-up, up to 16 while a server is
    idle, the larger's forward by the first step of that size (one forward recorded), its greedy
    recording by its fourth greedy step in a row. Every size gets a greedy recording: above 16
    rows the head's host work and a burst's scheduling passes were still 4-6 % of the default
    model's offline decode at 64 and 256 requests."""

    name = "native tapes"
    max_default_size = 512
    start_up_sizes_up_to = 8
    idle_sizes_up_to = 16
    greedy_sizes_up_to = None
    overhead_bytes = 128 * 1024  # a tape's calls: 304 of 232 bytes on the default model's 30 layers

    def __init__(self):
        self._arena = Arena()

    def default_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        return tuple(range(1, min(self.max_default_size, max_num_seqs) + 1))

    def record(self, forward):
        return record(forward, self._arena)
