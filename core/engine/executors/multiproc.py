"""MultiprocExecutor (``mp``): N tensor-parallel ranks on this machine. The engine core's
process is rank 0, the driver (:class:`engine.executors.driver.DriverExecutor`: the store,
the step broadcast, keep-alives, faults); ranks 1..N-1 are worker processes
(:func:`engine.executors.worker.run_worker`) reporting over a pipe each, meeting the driver
on loopback.

The workers start as ``python -m engine.executors.worker`` — the engine's own entry module,
handed its end of a socket pair — not through multiprocessing's ``spawn``, which re-imports
the user's main script in every child: a script that builds ``LLM(tensor_parallel_size=2)``
without an ``if __name__ == "__main__":`` guard then ran again in each rank and failed. Their
:class:`WorkerSpec` is the first message on the pipe."""

from __future__ import annotations

import socket
import subprocess
import sys
from multiprocessing.connection import Connection

from engine.executors.driver import STOP_GRACE_S, DriverExecutor, WorkerGroup, WorkerHandle


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
        code = self.process.poll()
        return None if code is None else f"(pid {self.process.pid}) exited with code {code}"

    def wait_stopped(self, timeout_s: float) -> None:
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass  # the driver's caller decides what a worker that will not stop means


class LocalWorkers(WorkerGroup):
    def release(self) -> None:
        for handle in self.handles:
            if handle.process.poll() is None:
                handle.process.kill()
                handle.wait_stopped(STOP_GRACE_S)
        for handle in self.handles:
            handle.conn.close()


class MultiprocExecutor(DriverExecutor):
    name = "mp"

    def launch(self, specs) -> LocalWorkers:
        handles = []
        for spec in specs:
            ours, theirs = socket.socketpair()
            process = subprocess.Popen(
                [sys.executable, "-m", "engine.executors.worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
            )
            theirs.close()
            conn = Connection(ours.detach())
            conn.send(spec)
            handles.append(ProcessHandle(spec.rank, process, conn))
        return LocalWorkers(handles)
