"""The engine core in its own process, for an asyncio front end: :class:`AsyncMPClient` starts
``python -m engine.client.core_process``, posts requests and aborts to it, awaits its outputs
and stops it.

Nothing here can block forever: posts never wait (no high-water mark, ``NOBLOCK``; the only
refusal is "no core connected", i.e. it died) and :meth:`AsyncMPClient.shutdown` gives the
core a bounded time to exit before killing it."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time

import zmq
import zmq.asyncio

from engine.client import protocol
from engine.client.base import Child, EngineCoreClient
from engine.client.liveness import Liveness
from engine.client.spawn import spawn_core
from engine.messages.lora import LoRARequest
from engine.messages.multimodal import MultiModalItem
from engine.messages.pooling_params import PoolingParams

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT = 10.0  # seconds the core gets to exit after Shutdown before it is killed
# A core that exits while starting has sent why (Fatal) first; a front end that notices the exit
# first (a core started early fails within a moment of its arguments) still reads it for this long.
LAST_WORDS_MS = 1000
WATCH_INTERVAL = 0.2  # seconds between looks at whether the core process still runs


class EngineDead(RuntimeError):
    """The engine cannot finish this request because its core died (the error code a
    front end reports, and what happened)."""

    code, what = "engine_dead", "the engine core died"


IPC_PREFIX = "engine-ipc-"  # + the front end's pid + "-": the folder of its sockets to the core
LEGACY_GRACE_SECONDS = 60.0  # an unnamed folder younger than this may not have bound its sockets yet


def remove_stale_ipc_dirs(root: str | None = None) -> list[str]:
    """Remove the socket folders of front ends that died without cleaning up (killed, or
    the machine lost power): they pile up in the temp folder otherwise. Only folders of this
    user whose process no longer runs go; -> the paths removed."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(IPC_PREFIX) and _ours(path) and _stale(path, name[len(IPC_PREFIX) :]):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _ours(path: str) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()


def _stale(path: str, suffix: str) -> bool:
    """``<pid>-<random>``: its process is gone. A folder named before the pid was part of the
    name: older than a minute and none of its sockets has a listener."""
    pid, dash, _ = suffix.partition("-")
    if dash and pid.isdigit():
        return not _alive(int(pid))
    try:
        if time.time() - os.lstat(path).st_mtime < LEGACY_GRACE_SECONDS:
            return False
        sockets = [os.path.join(path, entry) for entry in os.listdir(path)]
    except OSError:
        return False
    return not any(_listening(sock) for sock in sockets)


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: running
        return True
    return True


class AsyncMPClient(EngineCoreClient):
    def __init__(self, engine_options: dict, cpus: set[int] | None = None, rank: int = 0):
        self.options = engine_options
        self.cpus = cpus  # the CPUs the core is pinned to (None: this process's)
        self.rank = rank  # among the front end's data-parallel cores
        self.ready: protocol.Ready | None = None
        remove_stale_ipc_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")
        self.process: subprocess.Popen | None = None
        self.liveness = Liveness()  # the core's heartbeats, counted from its Ready
        self._calls: dict[int, asyncio.Future] = {}  # control calls awaiting their result
        self._call_ids = itertools.count()

    def launch(self) -> None:
        """Spawn the core now, so that it imports and loads its model while this process does
        its own start-up work (a server's tokenizer and routes); :meth:`start` waits for it."""
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        to_core, from_core = (f"ipc://{os.path.join(self._dir, n)}" for n in ("to-core", "from-core"))
        self._send = self._sync_ctx.socket(zmq.PUSH)  # sends never block; usable from finally blocks
        self._send.setsockopt(zmq.SNDHWM, 0)  # a busy core's backlog queues here instead of blocking
        self._send.bind(to_core)
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.bind(from_core)
        self.process = spawn_core(
            [
                "--input",
                to_core,
                "--output",
                from_core,
                "--options",
                json.dumps(self.options),
                "--parent-pid",
                str(os.getpid()),
                "--data-parallel-rank",
                str(self.rank),
            ],
            self.cpus,
        )

    async def start(self, timeout: float = 900) -> protocol.Ready:
        """The core's Ready, launching it first unless :meth:`launch` did."""
        if self.process is None:
            self.launch()
        try:
            return await self._wait_ready(timeout)
        except BaseException:
            self.process.kill()  # a core that never became ready must not outlive us
            raise

    def abandon(self) -> None:
        """Kill a launched core that will not be started (its front end failed to start)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self._ctx.destroy(linger=0)
            self._sync_ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _wait_ready(self, timeout: float) -> protocol.Ready:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.ready is None:
            exited = self.process.poll() is not None  # before the read: what it sent is read first
            if loop.time() > deadline:
                raise EngineDead("engine core did not become ready in time")
            if await self._recv.poll(LAST_WORDS_MS if exited else 200):
                message = protocol.decode_from_core(await self._recv.recv())
                if isinstance(message, protocol.Fatal):
                    raise EngineDead(message.message)
                if isinstance(message, protocol.Ready):
                    self.ready = message
                    self.liveness = Liveness()
            elif exited:
                raise EngineDead(f"engine core exited with code {self.process.returncode} while starting")
        await self._wait_connected(deadline)
        return self.ready

    async def _wait_connected(self, deadline: float) -> None:
        """Until our sending socket has its peer: the core connects to it just before it sends
        Ready, and ZMQ completes that connection on its own time, so a request sent the moment
        Ready arrives (a server checking its LoRA adapters) could find no peer yet."""
        loop = asyncio.get_running_loop()
        while not self._send.poll(0, zmq.POLLOUT):
            if self.process.poll() is not None or loop.time() > deadline:
                raise EngineDead("engine core did not connect after it became ready")
            await asyncio.sleep(0.005)

    def add(
        self,
        children: list[Child],
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
        mm_items: tuple[MultiModalItem, ...] = (),
    ) -> None:
        """Raises :class:`EngineDead` when no core is connected (it died, or we shut down)."""
        batch = protocol.AddBatch(
            [
                protocol.AddRequest(
                    rid,
                    prompt,
                    params.to_dict(),
                    priority,
                    cache_salt,
                    pooling=isinstance(params, PoolingParams),
                    kv_transfer_params=kv_transfer_params,
                    lora_request=None if lora_request is None else lora_request.to_dict(),
                    mm_items=[item.to_dict() for item in mm_items],
                )
                for rid, prompt, params in children
            ]
        )
        if not self._post(batch):
            raise EngineDead("the engine core is not connected")

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._post(protocol.Abort(request_ids))

    async def control(self, method: str, **arguments):
        """Call one of the core's :data:`~engine.client.protocol.CONTROL_METHODS` and await what it
        returns (those that wait for idle run once no request is in flight); ValueError if it raised.
        Results arrive through :meth:`get_output`, so its reader must be running."""
        if method not in protocol.CONTROL_METHODS:
            raise ValueError(f"no engine control {method!r} (known: {', '.join(protocol.CONTROL_METHODS)})")
        call_id = next(self._call_ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        if not self._post(protocol.Control(call_id, method, arguments)):
            del self._calls[call_id]
            raise EngineDead("the engine core is not connected")
        return await future

    def fail_calls(self, reason: str) -> None:
        """End every control call still awaiting its result with :class:`EngineDead`."""
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDead(reason))
        self._calls.clear()

    def _post(self, message) -> bool:
        """Queue ``message`` for the core without blocking. The socket has no high-water mark,
        so the only refusal (False) is no connected core: it died, or we shut down."""
        if self._send.closed:
            return False
        try:
            self._send.send(protocol.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def get_output(self) -> protocol.Outputs:
        """The core's next outputs; :class:`EngineDead` when it reports its failure. Heartbeats
        on the way are recorded in :attr:`liveness`."""
        while True:
            message = protocol.decode_from_core(await self._recv.recv())
            if isinstance(message, protocol.Heartbeat):
                self.liveness.record(message)
                continue
            if isinstance(message, protocol.Fatal):
                raise EngineDead(f"engine core failed: {message.message.strip().splitlines()[-1]}")
            if isinstance(message, protocol.ControlResult):
                self._resolve(message)
                continue
            return message

    def _resolve(self, message: protocol.ControlResult) -> None:
        future = self._calls.pop(message.call_id, None)
        if future is None or future.done():  # its caller gave up waiting
            return
        if message.error is not None:
            future.set_exception(ValueError(message.error))
        else:
            future.set_result(message.result)

    async def exited(self) -> int:
        """Returns the core process's exit code once it has exited."""
        while self.process.poll() is None:
            await asyncio.sleep(WATCH_INTERVAL)
        return self.process.returncode

    async def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT, failed: bool = False) -> None:
        """Stop the core and release the sockets in bounded time: Shutdown is posted (to a core
        that died unnoticed it is simply not delivered), the core gets ``timeout`` seconds to
        exit, then SIGKILL; a core known to have ``failed`` is killed at once."""
        if self.process is not None and self.process.poll() is None:
            if failed:  # it is on its way out: its teardown saves nothing
                self.process.kill()
            else:
                self._post(protocol.Shutdown())
            if not await _exited(self.process, timeout):
                logger.warning("engine core did not exit within %.0f s of shutdown; killing it", timeout)
                self.process.kill()
                await _exited(self.process, timeout)
        self._ctx.destroy(linger=0)
        self._sync_ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


async def _exited(process: subprocess.Popen, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while process.poll() is None:
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True
