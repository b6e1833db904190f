"""DriverExecutor: the part every multi-rank executor shares. The engine core's process is
rank 0, the driver; ranks 1..N-1 are workers (:mod:`engine.executors.worker`) that a
subclass launches where it places them (``mp``: spawned local processes; the ray plugin: Ray
actors) and reaches through one :class:`WorkerHandle` each. They meet at a ``TCPStore`` the
driver hosts: a gloo group carries the control plane (each step's input, broadcast from
rank 0, and the calls of a drafter that drafts on every rank), the platform's communicator the
layers' collectives (gloo on CPU, NCCL on CUDA).

Faults: every collective waits at most ``distributed_timeout``; while the engine is idle the
driver broadcasts a keep-alive every quarter of it, so a worker's wait for the next step is
bounded too, and a dead worker is noticed without a step. A worker that ends or reports a
failure, or a collective that fails, raises :class:`ExecutorFailure` naming the rank;
:meth:`shutdown` (also run when the executor is garbage-collected) stops every worker and
releases what the subclass reserved for them.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from abc import ABC, abstractmethod

import torch

from engine.distributed import GroupAddress, ObjectChannel, TensorParallel, open_store, process_group
from engine.executors import sleep_call
from engine.executors.drafter_call import DrafterCall, on_device
from engine.executors.sleep_call import SleepModeCall
from engine.executors.worker import STOP, WorkerSpec
from engine.interfaces import Executor, ExecutorFailure

REPORT_GRACE_S = 2.0  # after a failed collective, how long to wait for the worker's own report
STOP_GRACE_S = 5.0
POLL_S = 0.1
KEEP_ALIVE_POLL_S = 1.0  # at most this long between the keep-alive thread's looks at the clock


class WorkerHandle(ABC):
    """The driver's end of one worker rank. A worker reports ``("joining", None)`` once its
    plugins and platform are up, ``("ready", bytes read for its weights)`` once its KV cache
    is allocated, or ``("failed", traceback)`` whenever something stops it."""

    def __init__(self, rank: int):
        self.rank = rank
        self.pid: int | None = None  # the worker's process id, once known

    @abstractmethod
    def report(self, timeout_s: float) -> tuple[str, object] | None:
        """The worker's next report, waiting up to ``timeout_s``; None if none came."""

    @abstractmethod
    def send_kv_groups(self, kv_groups) -> None:
        """Hand the worker the KV cache groups to allocate; it then reports ``ready`` and steps."""

    @abstractmethod
    def exit_note(self) -> str | None:
        """How the worker ended (e.g. ``"(pid 12) exited with code -9"``); None while it runs."""

    @abstractmethod
    def wait_stopped(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the worker to end after :data:`STOP`."""


class WorkerGroup:
    """The workers an executor launched (ranks 1..N-1, in order) and what it reserved for
    them. :meth:`release` must end every worker still running and free the reservation,
    without the executor (it runs from a ``weakref.finalize`` too) and idempotently."""

    def __init__(self, handles: list[WorkerHandle]):
        self.handles = handles

    def release(self) -> None:
        """End the workers still running: at shutdown, after they were told to stop; when the
        executor is collected or the interpreter exits, at once (e.g. the engine failed to start)."""


# Speculation under tensor parallelism: the core asks for drafts on rank 0 between steps and
# they reach the other ranks as tokens of the next step's broadcast input; only rank 0 samples
# and verifies them. So a drafter that runs no model (ngram, suffix) or a model of its own,
# built unsharded on rank 0 (draft_model with "model"), works as it is, and one that calls the
# target's sharded layers drafts on every rank (Drafter.drafts_on_every_rank: eagle, mtp).
# Layer-skip self-drafting calls the target's sharded layers from rank 0 alone, collectives the
# other ranks never join.


def _speculation_refusal(spec: dict) -> str | None:
    """Why speculation by ``spec`` cannot run tensor-parallel (None: it can)."""
    method = spec.get("method")
    if method != "draft_model" or not spec.get("self_draft_layers"):
        return None
    why = 'self_draft_layers drafts with the target\'s own sharded layers (use a separate "model")'
    return (
        f"speculative decoding method {method!r} is not tensor-parallel yet: {why}, a collective "
        "the other ranks do not join while rank 0 drafts"
    )


def _keep_alive(executor_ref: weakref.ref[DriverExecutor], stopped: threading.Event, poll_s: float) -> None:
    """The keep-alive thread. It holds its executor weakly, so an executor nobody shut down is
    still collected (and its workers released)."""
    while not stopped.wait(poll_s):
        executor = executor_ref()
        if executor is None or not executor.keep_alive():
            return
        del executor


def _release(group: WorkerGroup, stopped: threading.Event, keep_alive: threading.Thread) -> None:
    """The executor's finalizer (shutdown, collection or interpreter exit): stop the keep-alive
    thread before the interpreter can end it inside a collective (a daemon thread woken there
    after finalization began aborts the process), then end the workers, which fails a
    collective that was stuck."""
    stopped.set()
    mine = keep_alive is threading.current_thread()
    if keep_alive.is_alive() and not mine:
        keep_alive.join(STOP_GRACE_S)
    group.release()
    if keep_alive.is_alive() and not mine:
        keep_alive.join(STOP_GRACE_S)


class DriverExecutor(Executor):
    """Rank 0 in this process, ranks 1..N-1 in workers a subclass launches (:meth:`launch`)."""

    @classmethod
    def supports(cls, config) -> list[str]:
        reasons = []
        spec = config.speculative_config
        if spec and (refusal := _speculation_refusal(spec)):
            reasons.append(refusal)
        if config.kv_connector:
            reasons.append("KV connectors are not tensor-parallel yet")
        return reasons

    def store_host(self) -> str:
        """The address the driver's store listens on, as the workers reach it."""
        return "127.0.0.1"

    @abstractmethod
    def launch(self, specs: list[WorkerSpec]) -> WorkerGroup:
        """Start one worker per spec (ranks 1..N-1) and return them; the driver then awaits
        their ``joining`` reports."""

    def __init__(self, ctx):
        super().__init__(ctx)
        config, platform = ctx.config, ctx.platform
        world = config.parallel.tensor_parallel_size
        timeout = config.parallel.distributed_timeout
        host = self.store_host()
        self._store = open_store(GroupAddress(host, 0, world, timeout), 0)
        self.address = address = GroupAddress(host, self._store.port, world, timeout)
        specs = [WorkerSpec(config, platform.name, rank, address, os.getpid()) for rank in range(1, world)]
        self.workers = group = self.launch(specs)
        self._stopped = threading.Event()
        self._keep_alive_thread = threading.Thread(
            target=_keep_alive,
            args=(weakref.ref(self), self._stopped, min(address.timeout_s / 4, KEEP_ALIVE_POLL_S)),
            name="engine-tp-keepalive",
            daemon=True,
        )
        self._finalizer = weakref.finalize(self, _release, group, self._stopped, self._keep_alive_thread)
        try:
            for handle in group.handles:
                self._await(handle, "joining")
        except BaseException:
            self._finalizer()
            raise
        self._threads = torch.get_num_threads()  # configure_rank may take a share; shutdown gives it back
        platform.configure_rank(0, world)
        self._channel = ObjectChannel(
            process_group("gloo", self._store, 0, address, "control"), 0, address.timeout
        )
        self._tp = TensorParallel(0, world, platform.communicator(self._store, 0, address))
        self._lock = threading.Lock()
        self._started = False
        self._failure: ExecutorFailure | None = None
        self._last_send = time.monotonic()
        self._bytes_read: list[int | None] = []
        self.steps_broadcast = self.step_bytes_broadcast = 0  # the control plane's cost (benchmarks/tp.py)

    @property
    def tensor_parallel(self) -> TensorParallel:
        return self._tp

    def start(self, runner, kv_groups) -> None:
        self.runner = runner
        self._started = True  # from here the workers step, so shutdown tells them to stop
        runner.forward_step = self._driver_forward
        for handle in self.workers.handles:
            handle.send_kv_groups(kv_groups)
        self._bytes_read = [getattr(runner.model, "weight_bytes_read", None)]
        try:
            for handle in self.workers.handles:
                self._bytes_read.append(self._await(handle, "ready"))
        except BaseException:
            self._finalizer()
            raise
        self._keep_alive_thread.start()

    def _await(self, handle: WorkerHandle, expected: str):
        """The detail of worker ``handle``'s next report, which must be ``expected``."""
        deadline = time.monotonic() + self.address.timeout_s
        while time.monotonic() < deadline:
            report = handle.report(POLL_S)
            if report is not None:
                kind, detail = report
                if kind == expected:
                    return detail
                raise ExecutorFailure(f"tensor-parallel rank {handle.rank} failed to start:\n{detail}")
            note = handle.exit_note()
            if note:
                raise ExecutorFailure(f"tensor-parallel rank {handle.rank} {note} while starting")
        raise ExecutorFailure(
            f"tensor-parallel rank {handle.rank} sent no {expected!r} within {self.address.timeout_s:g} s"
        )

    def execute(self, plan, group_tables, bitmask=None, kv_meta=None):
        with self._lock:
            self.check_health()
            try:
                return self.runner.execute(plan, group_tables, bitmask, kv_meta)
            except ExecutorFailure as exc:
                self._failure = self._explain(exc)
                raise self._failure from exc

    def drafter_call(self, drafter, name: str, *args):
        """Every rank runs ``drafter.<name>(*args)`` on its own drafter (the others' calls and
        what they share arrive on the control group, keep-alives held off meanwhile); rank 0's
        result. Like a forward, a failure part-way leaves the ranks out of step: fatal."""
        with self._lock:
            self.check_health()
            try:
                self._channel.send(DrafterCall(name, on_device(args, "cpu")))
                return getattr(drafter, name)(*args)
            except ExecutorFailure as exc:
                self._failure = self._explain(exc)
                raise self._failure from exc
            except Exception as exc:
                self._failure = ExecutorFailure(
                    f"rank 0's drafter failed in {name}, leaving the tensor-parallel ranks out of "
                    f"step: {type(exc).__name__}: {exc}"
                )
                raise self._failure from exc
            finally:
                self._last_send = time.monotonic()

    def sleep_mode_call(self, sleep_mode, name: str, *args) -> list:
        """Every rank runs ``sleep_mode.<name>(*args)`` on its own (the others' calls arrive on
        the control group, keep-alives held off meanwhile), then all gather each rank's outcome;
        a rank that raised is raised here, the ranks still in step."""
        call = SleepModeCall(name, args)
        with self._lock:
            self.check_health()
            try:
                self._channel.send(call)
                return sleep_call.results(self._channel.gather(sleep_call.run(sleep_mode, call)))
            except ExecutorFailure as exc:
                self._failure = self._explain(exc)
                raise self._failure from exc
            finally:
                self._last_send = time.monotonic()

    def share(self, value):
        self._channel.send(on_device(value, "cpu"))
        return value

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
            raise ExecutorFailure(
                f"rank 0 failed mid-forward, leaving the tensor-parallel ranks out of step: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _explain(self, failure: ExecutorFailure) -> ExecutorFailure:
        """The failure with what the workers say: a worker's report or how it ended, when one
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
        for handle in self.workers.handles:
            report = handle.report(0)
            if report is not None:
                notes.append(f"tensor-parallel rank {handle.rank} failed:\n{report[1]}")
            elif note := handle.exit_note():
                notes.append(f"tensor-parallel rank {handle.rank} {note}")
        return "; ".join(notes)

    def check_health(self) -> None:
        if self._failure is not None:
            raise self._failure
        dead = self._dead_ranks()
        if dead:
            self._failure = ExecutorFailure(dead)
            raise self._failure

    def keep_alive(self) -> bool:
        """Broadcast a keep-alive if nothing was sent for a quarter of the timeout; False once
        there is no point in another (stopped, or failed)."""
        with self._lock:
            if self._stopped.is_set() or self._failure is not None:
                return False
            if time.monotonic() - self._last_send < self.address.timeout_s / 4:
                return True
            try:
                self._channel.send(None)
                self._last_send = time.monotonic()
            except ExecutorFailure as exc:
                self._failure = self._explain(exc)
                return False
            return True

    def weight_bytes_read(self) -> list[int | None]:
        return list(self._bytes_read)

    def shutdown(self) -> None:
        torch.set_num_threads(self._threads)
        if not self._finalizer.alive:
            return
        self._stopped.set()
        with self._lock:
            if self._started and self._failure is None and not self._dead_ranks():
                try:
                    self._channel.send(STOP)
                    deadline = time.monotonic() + STOP_GRACE_S
                    for handle in self.workers.handles:
                        handle.wait_stopped(max(0.0, deadline - time.monotonic()))
                except ExecutorFailure:
                    pass  # a worker is gone: release() ends the rest
        self._finalizer()
