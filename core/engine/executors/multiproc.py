"""MultiprocExecutor (``mp``): N tensor-parallel ranks on this machine. The engine core's
process is rank 0, the driver (:class:`engine.executors.driver.DriverExecutor`: the store,
the step broadcast, keep-alives, faults); ranks 1..N-1 are spawned worker processes
(:func:`engine.executors.worker.run_worker`) reporting over a pipe each, meeting the driver
on loopback."""

from __future__ import annotations

import multiprocessing

from engine.executors.driver import STOP_GRACE_S, DriverExecutor, WorkerGroup, WorkerHandle
from engine.executors.worker import run_worker


class ProcessHandle(WorkerHandle):
    def __init__(self, rank: int, process, conn):
        super().__init__(rank)
        self.process, self.conn = process, conn
        self.pid = process.pid

    def report(self, timeout_s: float):
        try:
            if self.conn.poll(timeout_s):
                return self.conn.recv()
        except (EOFError, OSError):
            pass  # the worker is gone: exit_note says how
        return None

    def send_kv_groups(self, kv_groups) -> None:
        self.conn.send(kv_groups)

    def exit_note(self) -> str | None:
        if self.process.is_alive():
            return None
        return f"(pid {self.process.pid}) exited with code {self.process.exitcode}"

    def wait_stopped(self, timeout_s: float) -> None:
        self.process.join(timeout_s)


class LocalWorkers(WorkerGroup):
    def release(self) -> None:
        for handle in self.handles:
            if handle.process.is_alive():
                handle.process.kill()
                handle.process.join(STOP_GRACE_S)
        for handle in self.handles:
            handle.conn.close()


class MultiprocExecutor(DriverExecutor):
    name = "mp"

    def launch(self, specs) -> LocalWorkers:
        spawn = multiprocessing.get_context("spawn")
        handles = []
        for spec in specs:
            ours, theirs = spawn.Pipe()
            process = spawn.Process(
                target=run_worker, args=(spec, theirs), name=f"engine-tp-rank-{spec.rank}", daemon=True
            )
            process.start()
            theirs.close()
            handles.append(ProcessHandle(spec.rank, process, ours))
        self._workers = [handle.process for handle in handles]
        return LocalWorkers(handles)
