"""The engine-core process: owns the engine core (through an :class:`InProcessClient`), steps it
while there is work, and talks to its front end's process over two ZMQ sockets (PULL for
requests, PUSH for outputs).

    python -m engine.client.core_process --input ADDR --output ADDR --options JSON --parent-pid PID
                                         [--data-parallel-rank N]

A thread of its own sends a heartbeat every half second, saying whether the step loop still
goes round (:mod:`engine.client.heartbeat`), so that the front end can tell a hung core from a
busy one. It ignores SIGINT/SIGTERM (a signal to the whole process group must not cut the front end's
drain short: the front end says when to stop) and exits by itself when the front end's
process dies, so no orphan core survives it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback

import zmq

from engine.client import protocol
from engine.client.heartbeat import HeartbeatThread, LoopClock
from engine.client.inproc import InProcessClient
from engine.client.kv_events import ZmqEventPublisher
from engine.client.spawn import ARGUMENTS_ON_STDIN, read_arguments
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.kv_connectors import DEFAULT_KV_PORT
from engine.lifetime import exit_now, exit_with_parent
from engine.messages.lora import LoRARequest
from engine.messages.multimodal import MultiModalItem
from engine.messages.pooling_params import PoolingParams
from engine.messages.sampling_params import SamplingParams
from engine.messages.step import Asleep, Overloaded
from engine.plugins import load_plugins

STATS_INTERVAL = 0.25  # seconds between stats messages while busy
IDLE_WAIT_MS = 200  # an idle core's wait for requests
# Quiet time before the work start-up left to idle moments (recording decode steps) begins: a
# request that comes right after the core is ready is served at once, not behind a recording.
IDLE_WORK_AFTER_S = 0.5
TRANSFER_POLL_MS = 2  # a core waiting only on KV transfers steps this often to poll them
OUTPUT_SEND_TIMEOUT_MS = 30_000  # a front end that reads nothing for this long is gone or hung


class APIGone(RuntimeError):
    """The front end's process died or stopped reading our outputs: nobody is left to serve."""


class CoreServer:
    def __init__(
        self,
        client: InProcessClient,
        input_addr: str,
        output_addr: str,
        parent_pid: int,
        data_parallel_rank: int = 0,
    ):
        self.client = client
        self.core = core = client.core
        events = core.config.kv_events_config
        self.events = None
        if events is not None and events.publishing:
            medium = "GPU" if core.platform.device.type == "cuda" else "CPU"
            self.events = ZmqEventPublisher(events, medium, data_parallel_rank)
        self.parent_pid = parent_pid
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.output = self.context.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDTIMEO, OUTPUT_SEND_TIMEOUT_MS)
        self.output.connect(output_addr)
        self.running = True
        self.waiting: list[protocol.Control] = []  # controls that run once no request is in flight
        self._last_stats = 0.0
        self._last_busy = time.monotonic()  # for _quiet_for
        self.clock = LoopClock()
        self.heartbeat = HeartbeatThread(self.context, output_addr, self.clock)

    def send(self, message) -> None:
        try:
            self.output.send(protocol.encode(message), copy=False)
        except zmq.Again:
            raise APIGone(f"the API process read no outputs for {OUTPUT_SEND_TIMEOUT_MS // 1000} s") from None

    def send_fatal(self, message: str) -> None:
        """Best effort: an API process that stopped reading will notice our exit instead."""
        try:
            self.output.send(protocol.encode(protocol.Fatal(message)), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def handle(self, message, failed: list[protocol.Delta]) -> None:
        if isinstance(message, protocol.AddBatch):
            for request in message.requests:
                self.handle(request, failed)
        elif isinstance(message, protocol.AddRequest):
            try:
                if self.waiting:
                    raise Asleep(f"the engine is about to {self.waiting[0].method.replace('_', ' ')}")
                kind = PoolingParams if message.pooling else SamplingParams
                child = (message.request_id, message.prompt_token_ids, kind.from_dict(message.params))
                lora = None if message.lora_request is None else LoRARequest.from_dict(message.lora_request)
                mm_items = tuple(MultiModalItem.from_dict(item) for item in message.mm_items)
                self.client.add(
                    [child], message.priority, message.cache_salt, message.kv_transfer_params, lora, mm_items
                )
            except (ValueError, TypeError, Overloaded) as exc:  # this request alone fails
                failed.append(
                    protocol.Delta(
                        message.request_id,
                        [],
                        finish_reason="error",
                        error=str(exc),
                        error_code=getattr(exc, "code", None),
                    )
                )
        elif isinstance(message, protocol.Abort):
            self.client.abort(message.request_ids)
        elif isinstance(message, protocol.Shutdown):
            self.running = False
        elif isinstance(message, protocol.Control):
            if message.method in protocol.WAITS_FOR_IDLE and (self.waiting or self._busy()):
                self.waiting.append(message)
            else:
                self.run_control(message)

    def run_control(self, message: protocol.Control) -> None:
        try:
            result = self.client.control(message.method, **message.arguments)
        except (ValueError, TypeError, OSError) as exc:  # the call fails, the engine goes on
            self.send(protocol.ControlResult(message.call_id, error=str(exc)))
        else:
            self.send(protocol.ControlResult(message.call_id, result))

    def run_waiting_controls(self) -> None:
        while self.waiting and not self._busy():
            self.run_control(self.waiting.pop(0))

    def _busy(self) -> bool:
        return self.core.has_unfinished() or self.core.has_pending_transfers()

    def drain(self, wait_ms: int) -> list[protocol.Delta]:
        failed: list[protocol.Delta] = []
        if wait_ms and not self.input.poll(timeout=wait_ms):
            return failed
        while True:
            try:
                data = self.input.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return failed
            self.handle(protocol.decode_to_core(data), failed)

    def loop(self) -> None:
        idle_stats_sent = False
        self.heartbeat.start()
        while self.running:
            self.clock.round()
            if os.getppid() != self.parent_pid:
                raise APIGone("the API process exited")
            self.core.check_health()  # a tensor-parallel worker that died fails the engine, idle or not
            deltas = self.drain(self._wait_ms())
            if not self.running:
                break
            if self._busy():
                self.clock.step_started()
                deltas += self.client.step()
                self.clock.step_finished()
                idle_stats_sent = False
                self._last_busy = time.monotonic()
            elif not self.waiting and self._quiet_for() >= IDLE_WORK_AFTER_S:
                self.core.idle_work()
            if self.events is not None:
                self.events.publish(self.core.take_kv_events())
                self.events.serve_replay()
            now = time.monotonic()
            due = now - self._last_stats > STATS_INTERVAL
            idle = not self._busy()
            if deltas or due or (idle and not idle_stats_sent):
                send_stats = due or idle
                self.send(protocol.Outputs(deltas, self.client.stats() if send_stats else None))
                if send_stats:
                    self._last_stats = now
                idle_stats_sent = idle_stats_sent or idle
            self.run_waiting_controls()  # after the outputs of the step that ended the last request

    def _wait_ms(self) -> int:
        """How long to wait for requests before the next step: none while steps compute; a
        few milliseconds while only KV transfers are waited on (parked loads, delayed frees),
        which the steps poll; otherwise until a request comes (checking the parent meanwhile)."""
        if self.core.has_unfinished() and self.core.last_step_computed:
            return 0
        if self.core.has_unfinished() or self.core.has_pending_transfers():
            return TRANSFER_POLL_MS
        if self.core.has_idle_work():
            return max(0, min(IDLE_WAIT_MS, round((IDLE_WORK_AFTER_S - self._quiet_for()) * 1000)))
        return IDLE_WAIT_MS

    def _quiet_for(self) -> float:
        """Seconds since the last step (or since the core became ready)."""
        return time.monotonic() - self._last_busy

    def close(self) -> None:
        self.heartbeat.stop()  # before term(), which waits for its socket
        if self.events is not None:
            self.events.close()
        self.input.close(linger=0)
        self.output.close(linger=1000)
        self.context.term()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == [ARGUMENTS_ON_STDIN]:  # started early (``engine serve``): import, then wait
        _import_ahead()
        argv = read_arguments()
        if argv is None:
            return 0
    parser = argparse.ArgumentParser()
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--options", required=True, help="engine options as JSON")
    parser.add_argument("--parent-pid", type=int, required=True, help="the API process: we exit with it")
    parser.add_argument(
        "--data-parallel-rank",
        type=int,
        default=0,
        help="this core's place among the "
        "server's data-parallel cores (its KV events' rank and endpoint offset)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(levelname)s engine-core: %(message)s")
    _ignore_stop_signals()
    if not exit_with_parent(args.parent_pid):  # the step loop also compares os.getppid()
        return 1
    context = zmq.Context.instance()
    try:
        options = kv_port_of_rank(json.loads(args.options), args.data_parallel_rank)
        config = EngineConfig.from_kwargs(**options)
        core = EngineCore(config, load_plugins(config.plugins), record_while_idle=True)
    except Exception as exc:  # noqa: BLE001 - whatever stops the start-up is reported to the front end
        push = context.socket(zmq.PUSH)
        push.connect(args.output)
        push.send(protocol.encode(protocol.Fatal(f"engine failed to start: {exc}")))
        push.close(linger=2000)
        context.term()  # waits (up to the linger) until the message has left: we exit without teardown
        return 1
    client = InProcessClient(core, f"engine {args.data_parallel_rank}")
    server = CoreServer(client, args.input, args.output, args.parent_pid, args.data_parallel_rank)
    try:
        server.send(client.ready)
        server.loop()
    except APIGone as exc:
        print(f"engine-core: {exc}; exiting", file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 - a death of any kind is reported to the front end before exiting
        message = traceback.format_exc()
        server.send_fatal(message)
        print(message, file=sys.stderr)
        return 1
    finally:
        core.shutdown()
        server.close()
    return 0


def kv_port_of_rank(options: dict, rank: int) -> dict:
    """Data-parallel core i serves KV transfers on ``kv_port + i`` (vLLM's rule for its side channel)."""
    transfer = options.get("kv_transfer_config")
    if not rank or not isinstance(transfer, dict):
        return options
    port = transfer.get("kv_port", DEFAULT_KV_PORT)
    if isinstance(port, bool) or not str(port).isdigit():
        return options  # the engine refuses it, naming the key
    return {**options, "kv_transfer_config": {**transfer, "kv_port": int(port) + rank}}


def _import_ahead() -> None:
    """What every start-up imports once it has its arguments, imported while a core started
    early waits for them: transformers' auto classes (the loaders read the checkpoint's config
    and tokenizer through them) and the Llama config class, whose import pulls the modules
    every transformers config class shares (over a second: they import torch.distributed)."""
    import transformers

    transformers.AutoConfig, transformers.AutoTokenizer, transformers.LlamaConfig  # noqa: B018 - attribute access imports them


def _ignore_stop_signals() -> None:
    """SIGINT/SIGTERM arrive blocked (:mod:`engine.client.spawn` starts us so, to cover the imports);
    ignoring them discards any that came meanwhile, then they are unblocked harmlessly."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


if __name__ == "__main__":
    exit_now(main())  # everything is closed by now; torch's teardown would only delay the exit
