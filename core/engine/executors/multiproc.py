"""MultiprocExecutor (``mp``): N tensor-parallel ranks on this machine. The engine core's
process is rank 0, the driver; ranks 1..N-1 are spawned worker processes
(:mod:`engine.executors.worker`). They meet at a ``TCPStore`` the driver hosts on loopback:
a gloo group carries the control plane (each step's input, broadcast from rank 0), the
platform's communicator the layers' collectives (gloo on CPU, NCCL on CUDA).

Faults: every collective waits at most ``distributed_timeout``; while the engine is idle the
driver broadcasts a keep-alive every quarter of it, so a worker's wait for the next step is
bounded too, and a dead worker is noticed without a step. A worker that exits or reports a
failure, or a collective that fails, raises :class:`ExecutorFailure` naming the rank;
:meth:`shutdown` (also run when the executor is garbage-collected) stops every worker.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import weakref

import torch

from engine.distributed import (
    GroupAddress,
    ObjectChannel,
    TensorParallel,
    open_store,
    process_group,
)
from engine.executors.worker import STOP, WorkerSpec, run_worker
from engine.interfaces import Executor, ExecutorFailure

HOST = "127.0.0.1"
REPORT_GRACE_S = 2.0  # after a failed collective, how long to wait for the worker's own report
STOP_GRACE_S = 5.0


class MultiprocExecutor(Executor):
    name = "mp"

    @classmethod
    def supports(cls, config) -> list[str]:
        reasons = []
        if config.speculative_config:
            reasons.append("speculative decoding is not tensor-parallel yet")
        if config.kv_connector:
            reasons.append("KV connectors are not tensor-parallel yet")
        return reasons

    def __init__(self, ctx):
        super().__init__(ctx)
        config, platform = ctx.config, ctx.platform
        world = config.parallel.tensor_parallel_size
        timeout = config.parallel.distributed_timeout
        self._store = open_store(GroupAddress(HOST, 0, world, timeout), 0)
        self.address = address = GroupAddress(HOST, self._store.port, world, timeout)
        spawn = multiprocessing.get_context("spawn")
        self._workers, self._conns = [], []
        for rank in range(1, world):
            ours, theirs = spawn.Pipe()
            spec = WorkerSpec(config, platform.name, rank, address, os.getpid())
            process = spawn.Process(target=run_worker, args=(spec, theirs), name=f"engine-tp-rank-{rank}",
                                    daemon=True)
            process.start()
            theirs.close()
            self._workers.append(process)
            self._conns.append(ours)
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers, self._conns)
        for rank, conn in enumerate(self._conns, start=1):
            self._await(rank, conn, "joining")
        self._threads = torch.get_num_threads()  # configure_rank may take a share; shutdown gives it back
        platform.configure_rank(0, world)
        self._channel = ObjectChannel(process_group("gloo", self._store, 0, address, "control"), 0, address.timeout)
        self._tp = TensorParallel(0, world, platform.communicator(self._store, 0, address))
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._failure: ExecutorFailure | None = None
        self._last_send = time.monotonic()
        self._bytes_read: list[int | None] = []
        self.steps_broadcast = self.step_bytes_broadcast = 0  # the control plane's cost (benchmarks/tp.py)

    @property
    def tensor_parallel(self) -> TensorParallel:
        return self._tp

    def start(self, runner, kv_groups) -> None:
        self.runner = runner
        runner.forward_step = self._driver_forward
        for conn in self._conns:
            conn.send(kv_groups)
        self._bytes_read = [getattr(runner.model, "weight_bytes_read", None)]
        for rank, conn in enumerate(self._conns, start=1):
            self._bytes_read.append(self._await(rank, conn, "ready"))
        threading.Thread(target=self._keep_alive, name="engine-tp-keepalive", daemon=True).start()

    def _await(self, rank: int, conn, expected: str):
        """The detail of worker ``rank``'s next report, which must be ``expected``."""
        deadline = time.monotonic() + self.address.timeout_s
        process = self._workers[rank - 1]
        while time.monotonic() < deadline:
            if conn.poll(0.1):
                kind, detail = conn.recv()
                if kind == expected:
                    return detail
                raise ExecutorFailure(f"tensor-parallel rank {rank} failed to start:\n{detail}")
            if not process.is_alive():
                raise ExecutorFailure(f"tensor-parallel rank {rank} exited while starting "
                                      f"(exit code {process.exitcode})")
        raise ExecutorFailure(f"tensor-parallel rank {rank} sent no {expected!r} within "
                              f"{self.address.timeout_s:g} s")

    def execute(self, plan, group_tables, bitmask=None, kv_meta=None):
        with self._lock:
            self.check_health()
            try:
                return self.runner.execute(plan, group_tables, bitmask, kv_meta)
            except ExecutorFailure as exc:
                self._failure = self._explain(exc)
                raise self._failure from exc

    def _driver_forward(self, step):
        """Rank 0's forward: broadcast the step, then run it with the other ranks. Failing
        mid-forward leaves the ranks out of step, so any error here is fatal."""
        self._channel.send(step.to("cpu"))
        self._last_send = time.monotonic()
        self.steps_broadcast += 1
        self.step_bytes_broadcast += self._channel.last_bytes
        try:
            return self.runner.forward(step)
        except ExecutorFailure:
            raise
        except Exception as exc:
            raise ExecutorFailure(f"rank 0 failed mid-forward, leaving the tensor-parallel ranks out of step: "
                                  f"{type(exc).__name__}: {exc}") from exc

    def _explain(self, failure: ExecutorFailure) -> ExecutorFailure:
        """The failure with what the workers say: a worker's report or exit code, when one
        comes within a moment (a collective usually fails because a peer went away)."""
        deadline = time.monotonic() + REPORT_GRACE_S
        while time.monotonic() < deadline:
            dead = self._dead_ranks()
            if dead:
                return ExecutorFailure(f"{failure}; {dead}")
            time.sleep(0.05)
        return failure

    def _dead_ranks(self) -> str:
        notes = []
        for rank, (process, conn) in enumerate(zip(self._workers, self._conns), start=1):
            report = None
            try:
                if conn.poll():
                    report = conn.recv()[1]
            except (EOFError, OSError):
                pass
            if report is not None:
                notes.append(f"tensor-parallel rank {rank} failed:\n{report}")
            elif not process.is_alive():
                notes.append(f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}")
        return "; ".join(notes)

    def check_health(self) -> None:
        if self._failure is not None:
            raise self._failure
        dead = self._dead_ranks()
        if dead:
            self._failure = ExecutorFailure(dead)
            raise self._failure

    def _keep_alive(self) -> None:
        interval = self.address.timeout_s / 4
        while not self._stopped.wait(min(interval, 1.0)):
            with self._lock:
                if self._stopped.is_set() or self._failure is not None:
                    return
                if time.monotonic() - self._last_send < interval:
                    continue
                try:
                    self._channel.send(None)
                    self._last_send = time.monotonic()
                except ExecutorFailure as exc:
                    self._failure = self._explain(exc)
                    return

    def weight_bytes_read(self) -> list[int | None]:
        return list(self._bytes_read)

    def shutdown(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        torch.set_num_threads(self._threads)
        with self._lock:
            if self._failure is None and not self._dead_ranks():
                try:
                    self._channel.send(STOP)
                    deadline = time.monotonic() + STOP_GRACE_S
                    for process in self._workers:
                        process.join(max(0.0, deadline - time.monotonic()))
                except ExecutorFailure:
                    pass  # a worker is gone: _stop_workers ends the rest
        self._finalizer()


def _stop_workers(workers, conns) -> None:
    """End the workers still running (at shutdown, after they were told to stop; when the
    executor is collected or the interpreter exits, at once: e.g. the engine failed to start)."""
    for process in workers:
        if process.is_alive():
            process.kill()
            process.join(STOP_GRACE_S)
    for conn in conns:
        conn.close()
