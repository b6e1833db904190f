"""RayExecutor (``ray``): the engine core's process is rank 0, the driver (the core's
:class:`engine.executors.driver.DriverExecutor`: its store, the step broadcast over the
gloo control group, keep-alives, timeouts, faults), and ranks 1..N-1 are Ray actors running
the core's worker (:mod:`engine_executors_ray.actor`), one per bundle of a placement group.
Their store is the driver's, on the driver's node IP so that ranks on other nodes reach it.

A worker's reports are its stages' results: ``prepare`` (``joining``), then ``join``,
``start`` (``ready``) and ``loop``, submitted in order, so a stage that raises is a
``failed`` report with the actor's traceback and an actor that dies (killed, out of memory,
its node gone) fails the pending stage with Ray's reason. The actors are not detached: Ray
ends them, and removes the placement group, when the driver's process ends however it ends.
"""

from __future__ import annotations

import collections
import threading

try:
    import ray
except ImportError as exc:  # the plugin installed without its dependency
    raise ImportError("the ray executor needs the PyPI package `ray` (pip install ray)") from exc
import torch
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.executors.driver import DriverExecutor, WorkerGroup, WorkerHandle
from engine_executors_ray import cluster
from engine_executors_ray.actor import EngineWorker


class ActorHandle(WorkerHandle):
    def __init__(self, rank: int, actor, spec):
        super().__init__(rank)
        self.actor = actor
        # (report kind, or None for a stage that reports only if it fails; its result)
        self._stages = collections.deque(
            [("joining", actor.prepare.remote(spec)), (None, actor.join.remote())]
        )
        self._loop = None
        self._death: str | None = None
        self.node: str | None = None
        self._lock = threading.Lock()  # the engine's loop and the keep-alive thread both ask

    def report(self, timeout_s: float):
        with self._lock:
            return self._next_report(timeout_s)

    def _next_report(self, timeout_s: float):
        while self._stages and self._death is None:
            kind, ref = self._stages[0]
            ready, _ = ray.wait([ref], timeout=timeout_s)
            if not ready:
                return None
            self._stages.popleft()
            try:
                value = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:  # the stage raised: str() has the actor's traceback
                return "failed", str(exc)
            except ray.exceptions.RayError as exc:  # the actor is gone
                where = f", pid {self.pid} on {self.node}" if self.pid else ""
                self._death = f"(Ray actor {self.actor._actor_id.hex()[:12]}{where}) died: {_one_line(exc)}"
                return None
            if kind == "joining":
                self.pid, self.node = value
                return kind, None
            if kind is not None:
                return kind, value
        return None

    def send_kv_groups(self, kv_groups) -> None:
        with self._lock:
            self._stages.append(("ready", self.actor.start.remote(kv_groups)))
            self._loop = self.actor.loop.remote()
            self._stages.append((None, self._loop))

    def exit_note(self) -> str | None:
        return self._death

    def wait_stopped(self, timeout_s: float) -> None:
        if self._loop is not None:
            ray.wait([self._loop], timeout=timeout_s)


class RayWorkers(WorkerGroup):
    def __init__(self, handles: list[ActorHandle], placement):
        super().__init__(handles)
        self.placement = placement

    def release(self) -> None:
        if not ray.is_initialized():
            return  # this process left the cluster: Ray ended its actors and placement group
        for handle in self.handles:
            ray.kill(handle.actor, no_restart=True)
        if self.placement is not None:
            remove_placement_group(self.placement)
            self.placement = None


class RayExecutor(DriverExecutor):
    name = "ray"

    def store_host(self) -> str:
        cluster.connect()
        return ray.util.get_node_ip_address()

    def launch(self, specs) -> RayWorkers:
        world = self.ctx.config.parallel.tensor_parallel_size
        cpus = max(1, torch.get_num_threads() // world)  # a CPU rank's share, as mp's ranks get
        bundle = cluster.rank_resources(self.ctx.platform.device_type, cpus)
        if not specs:
            return RayWorkers([], None)
        placement = cluster.place(bundle, len(specs), self.ctx.config.parallel.distributed_timeout)
        actor_class = ray.remote(EngineWorker)
        handles = []
        for index, spec in enumerate(specs):
            actor = actor_class.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                max_restarts=0,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement, placement_group_bundle_index=index
                ),
            ).remote()
            handles.append(ActorHandle(spec.rank, actor, spec))
        return RayWorkers(handles, placement)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
