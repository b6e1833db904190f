"""Platform: the device the engine runs on. ``cpu`` and ``cuda`` are built in; a hardware
vendor ships another through ``register_platforms`` without forking the core.

Tensor parallelism (added with defaults, so interface v1 is unchanged): ``communicator``
builds the collectives parallel layers call, by default a ``torch.distributed`` group of
``dist_backend``; ``configure_rank`` sets a rank's process up (CPU: its share of the cores).

Interface v2 adds ``step_graphs`` (default: none; v1 platforms still load): how the platform
records a decode step's forward once per batch size and replays it — CUDA graphs on ``cuda``,
native tapes (``engine.native.tape``) on ``cpu-native``.

``StepGraphs.idle_sizes_up_to`` (added with a default, so v2 is unchanged) bounds what a server
records while idle; ``StepGraphs.greedy_sizes_up_to`` (the same) which sizes also get a greedy
recording.

Sleep mode (added with a default, so v2 is unchanged): ``release_memory`` gives a storage's
memory back while keeping its address; a platform that cannot refuses ``--enable-sleep-mode``.
``allocate_zeroed`` (default: ``torch.zeros``) makes the KV cache's tensors.

``place_weights`` (added with a default that does nothing, so v2 is unchanged) lets a platform
settle a loaded model's weight memory in place (``cpu``: 2 MiB pages)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from engine.distributed import Communicator, GroupAddress, ProcessGroupCommunicator, process_group


class StepGraphs(ABC):
    """A platform's way of recording a decode step's forward once and replaying it
    (``engine.runner.step_graphs`` drives it: static input buffers per batch size, the
    attention backend's :meth:`~engine.interfaces.AttentionBackend.build_graph_metadata`)."""

    name: ClassVar[str]  # what the start-up log calls them, e.g. "CUDA graphs"
    overhead_bytes: ClassVar[int] = 0  # device memory each recorded step holds beside its activations
    # the largest size recorded at start-up; a larger one is recorded the first time a step of it
    # runs (None: every size at start-up, as CUDA graphs need: they share one memory pool)
    start_up_sizes_up_to: ClassVar[int | None] = None
    # the largest size a server records while idle (None: every size); a larger one waits for its
    # first step, so that a request arriving mid-recording never waits behind a long one
    idle_sizes_up_to: ClassVar[int | None] = None
    # the largest size that also gets a greedy recording (the forward, the LM head and each
    # row's first maximum: a greedy step's tokens in one replay, and bursts of such steps); None:
    # every size. Where the head writes logits, the largest such size's are set aside too
    greedy_sizes_up_to: ClassVar[int | None] = 16
    # whether the recordings share one pool of activations (the largest bucket's sets the memory:
    # CUDA graphs, native tapes), or each keeps every activation its own forward allocated (every
    # bucket's, every layer's); the KV cache's budget sets that memory aside
    shares_activations: ClassVar[bool] = True

    def default_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        """The batch sizes to record when the user names none: vLLM's list (1, 2, 4, every 8
        to 248, every 16 from 256 to 512) below ``max_num_seqs``, and ``max_num_seqs`` itself
        (at most 512), so every batch up to 512 has a size that holds it."""
        sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
        return tuple(sorted({s for s in sizes if s < max_num_seqs} | {min(max_num_seqs, 512)}))

    @abstractmethod
    def record(self, forward: Callable[[], torch.Tensor]) -> tuple[object, torch.Tensor]:
        """(a recording of ``forward()`` with a ``replay()`` method, the tensor ``forward``
        returned, which every replay rewrites). Raises RuntimeError saying why it cannot
        record this forward; the engine then runs decode steps eagerly."""


class Platform(ABC):
    name: ClassVar[str]
    device_type: ClassVar[str]  # torch device type: "cpu", "cuda", "xpu" ...
    dist_backend: ClassVar[str]  # torch.distributed backend for tensor parallelism
    priority: ClassVar[int] = 0  # among available platforms the highest wins
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    preferred_attention_backends: ClassVar[tuple[str, ...]] = ()

    @classmethod
    @abstractmethod
    def unavailable_reasons(cls) -> list[str]:
        """Why this platform cannot run in this process; empty when it can."""

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    @abstractmethod
    def free_memory(self) -> int:
        """Bytes available for weights and KV cache now."""

    def memory_in_use(self) -> tuple[int, int]:
        """(bytes this process holds on the device now, the device's total bytes), for
        ``memory_utilization``; a platform that cannot tell raises NotImplementedError."""
        raise NotImplementedError(f"platform {self.name} cannot report its memory in use")

    def configure(self) -> None:
        """Process-wide set-up (threads, allocator) before the model is built."""

    def configure_rank(self, rank: int, world_size: int) -> None:
        """Set up tensor-parallel rank ``rank`` of ``world_size`` in its process (after
        ``configure``): e.g. bind the rank's device, or its share of the CPU cores."""

    def communicator(self, store, rank: int, address: GroupAddress) -> Communicator:
        """The collectives of rank ``rank`` in the group meeting at ``address`` (``store`` is
        its ``torch.distributed`` store). Default: a process group of ``dist_backend``."""
        group = process_group(self.dist_backend, store, rank, address, "device")
        return ProcessGroupCommunicator(group, rank, address.world_size, address.timeout)

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on synchronous devices)."""

    def step_graphs(self) -> StepGraphs | None:
        """(interface v2) How this platform records and replays decode steps, or None: they
        run eagerly. Called once per engine."""
        return None

    def allocate_zeroed(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor for the KV cache (gigabytes). A platform may map fresh zero pages
        instead of writing zeros (cpu), so that the pool costs neither start-up time nor memory
        until it fills."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def place_weights(self, storages: list[torch.UntypedStorage]) -> str | None:
        """Called once a model's weights are loaded and packed, with the storages of its
        parameters and buffers: settle their memory in place for the steps that stream them
        (same addresses, same bytes). Returns what it did, for the start-up log, or None (the
        default: nothing)."""
        return None

    def release_memory(self, storages: list[torch.UntypedStorage]) -> int:
        """Give the memory of ``storages`` back to the system while keeping their addresses (so
        recorded step graphs stay valid); their contents are undefined until rewritten. Returns
        the bytes released. For sleep mode (``/sleep``); the default cannot."""
        raise NotImplementedError(f"platform {self.name} cannot release memory in place (sleep mode)")

    def layer_ops(self, dtype: torch.dtype):
        """The :class:`engine.layers.LayerOps` models and quant kernels use for the small ops
        between matmuls (RMSNorm with the residual add, rotary embedding, SwiGLU, W8A8's
        activation quantization and rescale) in ``dtype``. The default is plain torch; a
        platform with fused kernels returns a subclass overriding those it does better,
        checked by ``engine.testing.layer_ops``. Called once per layer at load: cache it."""
        from engine.layers.ops import LayerOps

        return LayerOps()
