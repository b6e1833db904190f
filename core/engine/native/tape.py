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
watched: an op that computes (anything but a view or an allocation) is work a replay would skip,
so the capture fails naming it (:class:`CaptureError`) and the engine keeps running eagerly; the
tensors the forward allocates are kept alive with the tape, whose kernels hold their addresses.
A kernel whose result steers Python (an ``int64_t`` count or flag, rather than an
``engine_status``) cannot be recorded either: the branch taken at capture would be replayed for
every input.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import struct
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.interfaces import StepGraphs
from engine.native import Library, Prototype, load_source

SOURCE = Path(__file__).with_name("tape.c")
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

    __slots__ = ("_floats", "_unrecordable", "address", "function", "name", "status")

    def __init__(self, function, prototype: Prototype):
        self.name, self.function, self.status = prototype.name, function, prototype.status
        self.address = ctypes.cast(function, ctypes.c_void_p).value
        self._floats = tuple(type_ is ctypes.c_float for type_ in prototype.argtypes)
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


class Tape:
    """Recorded kernel calls, replayed in order by one C call; holds the tensors they address."""

    def __init__(self, calls: list[tuple[NativeKernel, tuple]], keep: list):
        self.names = [kernel.name for kernel, _ in calls]
        self._ops = (_Op * len(calls))(*(kernel.op(args) for kernel, args in calls))
        self._keep = keep
        self._run = _library().tape_run

    def __len__(self) -> int:
        return len(self.names)

    def replay(self) -> None:
        failed = self._run(ctypes.addressof(self._ops), len(self.names))
        if failed:
            raise ReplayError(f"kernel {self.names[failed - 1]} (op {failed} of the tape) refused its input")


class _Recording(TorchDispatchMode):
    """Collects kernel calls; watches torch ops: keeps what they return, notes what computes."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[NativeKernel, tuple]] = []
        self.keep: list = []
        self.computed: list[str] = []

    def add(self, kernel: NativeKernel, args: tuple) -> None:
        self.calls.append((kernel, args))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func.is_view or func in _ALLOCATIONS) and str(func) not in self.computed:
            self.computed.append(str(func))
        self.keep.append(out)
        return out


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


def record(forward: Callable[[], torch.Tensor]) -> tuple[Tape, torch.Tensor]:
    """(the tape of ``forward()``'s kernel calls, the tensor it returned — which every replay
    rewrites). Raises :class:`CaptureError` when the forward did work a tape cannot replay."""
    with recording() as recorder:
        out = forward()
    if recorder.computed:
        raise CaptureError(
            f"the forward computes with torch ops a tape cannot replay "
            f"({', '.join(recorder.computed[:4])}{' ...' if len(recorder.computed) > 4 else ''})"
        )
    if not recorder.calls:
        raise CaptureError("the forward called no native kernel")
    return Tape(recorder.calls, [*recorder.keep, out]), out


class TapeGraphs(StepGraphs):
    """Decode steps recorded as native tapes, for a platform whose kernels are bound with
    :func:`bind`. By default every batch size up to 16: a tape saves the same per-kernel Python
    cost at any size, which still mattered at 9-16 rows (10-25% of the default model's decode
    throughput), and a padded row costs real matmul work on a CPU (one 16-row tape for 9 rows
    was 8% slower than eager), so no size is padded. Each tape keeps its forward's activations
    alive (0.42 MiB a row on the default model). Sizes above 8 are recorded the first time a
    step of that size runs (or while a server is idle), so an engine that never batches more
    than 8 requests starts as fast as before."""

    name = "native tapes"
    max_default_size = 16
    start_up_sizes_up_to = 8
    shares_activations = False

    def default_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        return tuple(range(1, min(self.max_default_size, max_num_seqs) + 1))

    def record(self, forward):
        return record(forward)
