"""A tensor-parallel worker: rank r > 0 of the ``mp`` executor, in its own spawned process.

It builds what rank 0 builds (plugins with the engine's allow-list, the platform, its share
of the model, the attention backends), then its KV cache once the driver says how many
blocks, and steps: each step's :class:`engine.runner.model_runner.StepInput` arrives by
broadcast and the worker runs the same forward, joining its collectives. ``None`` is the
driver's keep-alive between steps, :data:`STOP` the end. It reports over its pipe:
``("joining", None)`` once its plugins and platform are up (the driver then joins the
process groups), ``("ready", bytes read for its weights)`` or ``("failed", traceback)``. It dies with the
driver (Linux ``PR_SET_PDEATHSIG``, and a watchdog comparing ``os.getppid()``). Plugins
registered in the driver's process only (``engine.plugins.add_plugin``) do not exist here:
an allow-list naming one fails the worker's start, reported to the driver.
"""

from __future__ import annotations

import os
import traceback

import attrs

from engine.core import setup
from engine.distributed import GroupAddress, ObjectChannel, TensorParallel, open_store, process_group
from engine.lifetime import exit_with_parent, watch_parent
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
    def __init__(self, spec: WorkerSpec, conn):
        config, rank, address = spec.config, spec.rank, spec.address
        registry = load_plugins(config.plugins)
        self.platform = platform = setup.select_platform(registry, spec.platform)
        platform.configure()
        platform.configure_rank(rank, address.world_size)
        conn.send(("joining", None))  # the driver joins the groups only now: a failure above cannot hang it
        self.store = open_store(address, rank)
        self.control = ObjectChannel(process_group("gloo", self.store, rank, address, "control"), rank,
                                     address.timeout)
        tp = TensorParallel(rank, address.world_size, platform.communicator(self.store, rank, address))
        loader, _ = setup.select_loader(registry, config.model.model, config.model.load_format)
        hf_config = loader.hf_config()
        self.dtype = dtype = setup.resolve_dtype(config.model.dtype, hf_config, platform)
        self.model = setup.build_model(registry, loader, hf_config, dtype, platform, config.model.quantization,
                                       config.batch_invariant, tp)
        _, layer_group = setup.kv_group_of_layers(self.model.kv_layout())
        self.layers = setup.layer_attention(registry, config.attention_backend, self.model, dtype,
                                            config.cache.block_size, platform, config.batch_invariant, layer_group)
        self.block_size = config.cache.block_size

    def start(self, kv_groups):
        from engine.runner.model_runner import ModelRunner

        caches = setup.allocate_kv_caches(self.layers, kv_groups, self.dtype, self.platform.device)
        self.runner = ModelRunner(self.model, self.layers, caches, self.block_size, self.platform.device)

    def loop(self) -> None:
        while True:
            message = self.control.receive()
            if message is None:
                continue
            if message == STOP:
                return
            self.runner.forward(message.to(self.platform.device))


def run_worker(spec: WorkerSpec, conn) -> None:
    """The worker process's entry point."""
    if not exit_with_parent(spec.driver_pid):
        os._exit(1)
    watch_parent(spec.driver_pid)
    try:
        worker = Worker(spec, conn)
        if not conn.poll(spec.address.timeout_s):
            raise TimeoutError(f"no KV cache size from the driver within {spec.address.timeout_s:g} s")
        worker.start(conn.recv())
        conn.send(("ready", getattr(worker.model, "weight_bytes_read", None)))
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
