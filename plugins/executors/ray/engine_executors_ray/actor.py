"""A tensor-parallel worker rank as a Ray actor: the core's
:class:`engine.executors.worker.Worker` with each of its stages a method, so that a stage's
return value, or its traceback, is the worker's report to the driver."""

from __future__ import annotations

import os

import ray

from engine.executors.worker import Worker, WorkerSpec


class EngineWorker:
    def prepare(self, spec: WorkerSpec) -> tuple[int, str]:
        """Plugins (the engine's allow-list) and the platform; (pid, node IP) of this actor."""
        self.worker = Worker(spec)
        return os.getpid(), ray.util.get_node_ip_address()

    def join(self) -> None:
        self.worker.join()

    def start(self, kv_groups) -> int | None:
        return self.worker.start(kv_groups)

    def loop(self) -> None:
        self.worker.loop()
