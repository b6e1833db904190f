"""A tensor-parallel worker: rank r > 0 of a multi-rank executor, in a process of its own (a
process ``mp`` spawns, a Ray actor ...).

It builds what rank 0 builds, in stages the driver paces: :class:`Worker` loads plugins with
the engine's allow-list and sets up the platform (then it reports ``joining``: only now does
the driver enter the process-group rendezvous, so a failure before it is one error naming the
rank); :meth:`Worker.join` joins the groups on the driver's store and builds its share of the
model and the attention backends; :meth:`Worker.start` allocates its KV cache once the driver
says how many blocks (``ready``, with the bytes read for its weights); :meth:`Worker.loop`
steps: each step's :class:`engine.runner.model_runner.StepInput` arrives by broadcast and
the worker runs the same forward, joining its collectives. ``None`` is the driver's
keep-alive between steps, :data:`STOP` the end; a :class:`DrafterCall` runs a call of a
drafter that drafts on every rank (``Drafter.drafts_on_every_rank``, built at start) on this
rank's own instance, whose ``DrafterContext.share`` receives what rank 0 shares; a
:class:`SleepModeCall` runs on this rank's own :class:`engine.core.sleep.SleepMode` (sleep,
wake, a weight update's steps) and its outcome is gathered to every rank. Plugins
registered in the driver's process only (``engine.plugins.add_plugin``) do not exist here:
an allow-list naming one fails the worker's start, reported to the driver.

:func:`run_worker` is ``mp``'s process (started as ``python -m engine.executors.worker FD``,
its spec the first message on the pipe at FD): the stages reported over that pipe as
``("joining", None)``, ``("ready", bytes read)`` or ``("failed", traceback)``; it dies with
the driver (Linux ``PR_SET_PDEATHSIG``, and a watchdog comparing ``os.getppid()``).
"""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Connection

import attrs

from engine.core import kv_sizing, setup
from engine.core.sleep import SleepMode
from engine.distributed import GroupAddress, ObjectChannel, TensorParallel, open_store, process_group
from engine.executors import sleep_call
from engine.executors.drafter_call import DrafterCall, on_device
from engine.executors.sleep_call import SleepModeCall
from engine.lifetime import exit_with_parent, watch_parent
from engine.lora.manager import LoRAManager
from engine.plugins import load_plugins

STOP = "stop"


@attrs.frozen
class WorkerSpec:
    config: object  # the driver's resolved EngineConfig
    platform: str  # the driver's platform, by name
    rank: int
    address: GroupAddress
    driver_pid: int


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.registry = load_plugins(spec.config.plugins)
        self.platform = platform = setup.select_platform(self.registry, spec.platform)
        platform.configure()
        platform.configure_rank(spec.rank, spec.address.world_size)
        self._sleep: SleepMode | None = None

    def join(self) -> None:
        """Join the driver's process groups, then build this rank's model and attention."""
        config, rank, address, platform = self.spec.config, self.spec.rank, self.spec.address, self.platform
        self.store = open_store(address, rank)
        self.control = ObjectChannel(
            process_group("gloo", self.store, rank, address, "control"), rank, address.timeout
        )
        self.tp = tp = TensorParallel(
            rank, address.world_size, platform.communicator(self.store, rank, address)
        )
        model, load_format = config.model.model, config.model.load_format
        self.loader = loader = setup.select_loader(self.registry, model, load_format)[0]
        self.hf_config = hf_config = loader.hf_config()
        self.dtype = dtype = setup.resolve_dtype(config.model.dtype, hf_config, platform)
        self.model = setup.build_served_model(self.registry, config, loader, hf_config, dtype, platform, tp)
        setup.calculate_kv_scales(self.model, config)
        _, layer_group = kv_sizing.kv_group_of_layers(self.model.kv_layout())
        self.layers = setup.layer_attention(
            self.registry,
            config.attention_backend,
            self.model,
            dtype,
            config.cache.block_size,
            platform,
            config.batch_invariant,
            layer_group,
            setup.kv_cache_dtype(config),
        )
        self.block_size = config.cache.block_size

    def start(self, kv_groups) -> int | None:
        """Allocate the KV cache for ``kv_groups`` (rank 0's block counts); the bytes this rank
        read for its weights (None: its loader does not count)."""
        from engine.runner.model_runner import ModelRunner

        caches = kv_sizing.allocate_kv_caches(self.layers, kv_groups, self.platform)
        self.runner = ModelRunner(self.model, self.layers, caches, self.block_size, self.platform.device)
        lora = self.spec.config.lora
        if lora.enable_lora:  # this rank's part of each adapter, in the slots rank 0 chooses
            ops = self.platform.layer_ops(self.dtype)
            self.runner.lora = LoRAManager(self.model, lora, self.dtype, self.platform.device, ops)
        self.drafter = self._drafter(caches, kv_groups[0].num_blocks)
        return getattr(self.model, "weight_bytes_read", None)

    def _drafter(self, caches, num_blocks):
        """This rank's drafter, when the engine's drafts on every rank (None otherwise)."""
        spec = self.spec.config.speculative_config
        cls = self.registry.get("drafters", spec.get("method")) if spec else None
        if not getattr(cls, "drafts_on_every_rank", False):
            return None
        target = (self.model, self.layers.first, caches, num_blocks)
        ctx = setup.drafter_context(
            self.registry,
            self.spec.config,
            self.platform,
            self.dtype,
            self.loader,
            self.hf_config,
            target,
            None,
            lambda _: on_device(self.control.receive(), self.platform.device),
        )
        return cls(ctx)

    def sleep_mode(self) -> SleepMode:
        """This rank's sleep mode, built at the first call the driver sends."""
        if self._sleep is None:
            self._sleep = setup.sleep_mode(
                self.registry, self.spec.config, self.platform, self.model, self.runner.kv_caches, self.tp
            )
        return self._sleep

    def loop(self) -> None:
        """Run every step the driver broadcasts until it sends :data:`STOP`."""
        while True:
            message = self.control.receive()
            if message is None:
                continue
            if message == STOP:
                return
            if isinstance(message, DrafterCall):
                getattr(self.drafter, message.name)(*on_device(message.args, self.platform.device))
            elif isinstance(message, SleepModeCall):
                self.control.gather(sleep_call.run(self.sleep_mode(), message))
            else:
                self.runner.forward(message.to(self.platform.device))


def run_worker(spec: WorkerSpec, conn) -> None:
    """The ``mp`` worker process's entry point."""
    if not exit_with_parent(spec.driver_pid):
        os._exit(1)
    watch_parent(spec.driver_pid)
    try:
        worker = Worker(spec)
        conn.send(("joining", None))  # the driver joins the groups only now: a failure above cannot hang it
        worker.join()
        if not conn.poll(spec.address.timeout_s):
            raise TimeoutError(f"no KV cache size from the driver within {spec.address.timeout_s:g} s")
        conn.send(("ready", worker.start(conn.recv())))
        worker.loop()
    except BaseException:  # noqa: BLE001 - whatever stops the worker is reported to the driver
        _report(conn, traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _report(conn, message: str) -> None:
    try:
        conn.send(("failed", message))
    except OSError:
        pass  # the driver is gone


def main(argv: list[str]) -> None:
    """``python -m engine.executors.worker FD``: receive the spec on the pipe at FD, run it."""
    conn = Connection(int(argv[0]))
    run_worker(conn.recv(), conn)


if __name__ == "__main__":
    main(sys.argv[1:])
