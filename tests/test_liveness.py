"""A hung engine core is visible: the core's heartbeats (from a thread apart from its step loop)
turn /health 503 while it has work and makes no progress, streams get SSE keep-alives (blank line pairs)
while no token comes, and --engine-step-timeout fails the requests and exits non-zero. The
server tests stop the core with SIGSTOP (no thread runs: the heartbeats stop) and hang one
step in a logits processor (the heartbeats go on and report the step growing old)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
import zmq

from engine.client import protocol
from engine.client.async_engine import RequestHandle
from engine.client.heartbeat import HeartbeatThread, LoopClock
from engine.client.liveness import Liveness
from engine_server.keepalive import QUIET
from tests.plugin_packages import environ_with, write_distribution
from tests.serving import error_codes, gone, serve

# -- the pieces ------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_core_is_never_judged_a_silent_busy_one_is():
    clock = FakeClock()
    liveness = Liveness(clock)
    clock.now += 60
    assert liveness.problem(2.0, in_flight=0) is None  # nothing waits on it
    assert liveness.problem(2.0, in_flight=3) == (
        "engine core sent no heartbeat for 60.0 s (its process is stopped or frozen) "
        "while 3 requests are in flight"
    )
    liveness.record(protocol.Heartbeat(0.1, 7, False))
    clock.now += 1.5
    assert liveness.problem(2.0, in_flight=3) is None  # 1.6 s since the loop came round


def test_heartbeats_that_report_one_old_step_are_a_hang():
    clock = FakeClock()
    liveness = Liveness(clock)
    liveness.record(protocol.Heartbeat(12.25, 40, True))
    problem = liveness.problem(10.0, in_flight=1)
    assert problem.startswith("engine core has been in one step for 12.2 s while 1 request is in flight")
    assert "after 40 steps" in problem
    liveness.record(protocol.Heartbeat(0.0, 41, False))
    assert liveness.problem(10.0, in_flight=1) is None


def test_the_heartbeat_thread_beats_through_a_long_step():
    """A step that takes longer than the beat interval (sleeping: the GIL is free, as in a
    torch op) does not silence the thread; the beats report it growing old."""
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    address = "inproc://heartbeats"
    pull.bind(address)
    clock = LoopClock()
    clock.round()
    clock.step_started()
    beats = HeartbeatThread(context, address, clock, interval=0.05)
    beats.start()
    try:
        time.sleep(0.5)
        received = []
        while pull.poll(0):
            received.append(protocol.decode_from_core(pull.recv()))
        clock.step_finished()
    finally:
        beats.stop()
        pull.close(linger=0)
        context.term()
    assert len(received) >= 5 and all(b.stepping and b.steps == 0 for b in received)
    assert received[-1].round_age > received[0].round_age and received[-1].round_age >= 0.35


def test_a_handle_says_quiet_without_losing_the_delta_in_flight():
    """Each quiet interval gives QUIET; a delta that arrives while one is timed out is the
    next item (``Queue.get`` is cancelled, not the generator); queued deltas come unawaited."""

    async def run():
        handle = RequestHandle(None, ["a"])  # type: ignore[arg-type]  # no engine: nothing aborts
        loop = asyncio.get_running_loop()
        loop.call_later(0.35, handle.queue.put_nowait, protocol.Delta("a", [1]))
        loop.call_later(0.35, handle.queue.put_nowait, protocol.Delta("a", [2], finish_reason="length"))
        items = [item async for item in handle.deltas(quiet_after=0.1)]
        plain = RequestHandle(None, ["b"])  # type: ignore[arg-type]
        plain.queue.put_nowait(protocol.Delta("b", [3], finish_reason="stop"))
        return items, [d.token_ids async for d in plain.deltas()]

    items, plain = asyncio.run(run())
    tokens = [item.token_ids for item in items if item is not QUIET]
    assert tokens == [[1], [2]] and 2 <= items.count(QUIET) <= 4 and items[-2:] != [QUIET, QUIET]
    assert plain == [[3]]


def test_a_handle_without_quiet_after_waits_for_its_delta():
    async def run():
        handle = RequestHandle(None, ["a"])  # type: ignore[arg-type]
        asyncio.get_running_loop().call_later(
            0.2, handle.queue.put_nowait, protocol.Delta("a", [7], finish_reason="stop")
        )
        return [item async for item in handle.deltas()]

    items = asyncio.run(run())
    assert [d.token_ids for d in items] == [[7]]


# -- a real server ---------------------------------------------------------------------

PLUGIN = '''\
"""test-liveness: paces every step by 10 ms (so tiny-model streams are still running when a
test acts) and, while {trigger} exists, never finishes a step: it sleeps, with the GIL free and
every thread of the process alive, as a deadlocked step does."""

import os
import time

from engine import hookimpl
from engine.interfaces import LogitsProcessor


@hookimpl
def register_logits_processors(register):
    register("test-liveness", Pace, api=1)


class Pace(LogitsProcessor):
    def apply(self, logits, requests):
        time.sleep(0.01)
        deadline = time.monotonic() + 120
        while os.path.exists({trigger!r}) and time.monotonic() < deadline:
            time.sleep(0.05)
        return logits
'''

# eager: a decode step's recording (idle, or by the step that first needs it) is a legitimately
# long round that a slow machine stretches past these tests' 2 s limits
TINY = ("--dtype", "float32", "--num-blocks", "128", "--max-model-len", "512", "--enforce-eager")


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """(environment with the test-liveness plugin on the path, the file that hangs its steps)."""
    root = tmp_path_factory.mktemp("liveness-plugin")
    trigger = root / "hang"
    source = PLUGIN.format(trigger=str(trigger))
    write_distribution(
        root / "site", "tessellm-logits-test-liveness", "test-liveness", "test_liveness", source
    )
    return environ_with(root / "site"), trigger


KEEPALIVE = None  # what RawStream waits for to return at the first keep-alive


class RawStream:
    """A streaming completion read line by line on a thread, each line with its arrival time,
    so a test sees the keep-alives the ``openai`` client skips; returns once a line starting
    with ``wait_for`` came (by default: a data frame, i.e. the stream is mid-generation), or a
    keep-alive (``KEEPALIVE``)."""

    def __init__(self, server, wait_for: str | None = "data: ", **body):
        self.wait_for = wait_for
        self.lines: list[tuple[float, str]] = []
        self.blanks: list[float] = []  # arrival times of the keep-alives' blank lines
        self.started = threading.Event()
        body = {"model": server.model(), "prompt": "Hello", "ignore_eos": True, "stream": True, **body}
        self._thread = threading.Thread(target=self._read, args=(server, body), daemon=True)
        self._thread.start()
        assert self.started.wait(60), "the stream did not start"

    def _read(self, server, body) -> None:
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
                previous = None
                for line in response.iter_lines():
                    now = time.monotonic()
                    self.lines.append((now, line))
                    if line == "" and previous in (None, ""):  # a blank line that ends no frame
                        self.blanks.append(now)
                    previous = line
                    if self._waited_for(line):
                        self.started.set()
        finally:
            self.started.set()

    def _waited_for(self, line: str) -> bool:
        if self.wait_for is KEEPALIVE:
            return self.keepalives_since(0) > 0
        return line.startswith(self.wait_for)

    def keepalives_since(self, t: float) -> int:
        """The keep-alives that came from ``t`` on: each is two blank lines that end no frame."""
        return sum(1 for at in self.blanks if at >= t) // 2

    def frames(self, timeout: float = 30) -> list[str]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        return [line[6:] for _, line in self.lines if line.startswith("data: ")]


def wait_health(server, status: int, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        response = httpx.get(f"{server.url}/health", timeout=2)
        if response.status_code == status:
            return response
        assert time.monotonic() < deadline, f"/health stayed {response.status_code}: {response.text}"
        time.sleep(0.05)


@contextlib.contextmanager
def stopped(pid: int):
    """Process ``pid`` stopped (SIGSTOP) for the block, continued after it whatever happens;
    yields when it was stopped."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_stopped_core_turns_health_503_keeps_streams_alive_and_recovers(tiny_llama, plugin):
    env, _ = plugin
    args = (*TINY, "--logits-processors", "test-liveness", "--engine-heartbeat-timeout", "2")
    with serve(tiny_llama[0], *args, "--stream-keepalive-interval", "0.5", api_key=None, env=env) as server:
        core = server.core_pid()
        with stopped(core):  # idle: nothing waits on it, so no 503
            time.sleep(2.5)
            assert httpx.get(f"{server.url}/health").status_code == 200
        time.sleep(1)  # two beats: the first after the stop still reports the round the stop held

        stream = RawStream(server, max_tokens=200, stream_options={"include_usage": True})
        with stopped(core) as since:
            unhealthy = wait_health(server, 503, timeout=5)
            after = time.monotonic() - since
            # the limit (2 s) less the age of the last beat and of its round (a beat interval and a step)
            assert 0.8 < after < 4, after
            error = unhealthy.json()["error"]
            assert error["code"] == "engine_unresponsive"
            assert "sent no heartbeat for" in error["message"], error
            assert "1 request is in flight" in error["message"], error
            assert stream.keepalives_since(since) >= 2
            late = RawStream(server, wait_for=KEEPALIVE, max_tokens=20)  # headers, then keep-alives
            assert not any(line.startswith("data: ") for _, line in late.lines)
        resumed = time.monotonic()
        wait_health(server, 200, timeout=3)
        assert time.monotonic() - resumed < 2
        frames = stream.frames()
        assert frames[-1] == "[DONE]" and not error_codes(frames), frames[-3:]
        assert json.loads(frames[-2])["usage"]["completion_tokens"] == 200
        frames = late.frames()
        assert frames[-1] == "[DONE]" and not error_codes(frames), frames[-3:]


def test_the_step_timeout_fails_a_stopped_cores_requests_and_exits_nonzero(tiny_llama, plugin):
    env, _ = plugin
    args = (*TINY, "--logits-processors", "test-liveness", "--engine-step-timeout", "2")
    with serve(tiny_llama[0], *args, api_key=None, env=env) as server:
        core, client, model = server.core_pid(), server.openai(), server.model()
        outcome = {}

        def complete():
            try:
                client.completions.create(
                    model=model, prompt="Hi", max_tokens=300, extra_body={"ignore_eos": True}
                )
            except openai.APIStatusError as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=complete)
        thread.start()
        stream = client.completions.create(
            model=model, prompt="Hello", max_tokens=300, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)
        server.wait_for_metric("vllm:num_requests_running", lambda running: running == 2)
        with stopped(core) as since, pytest.raises(openai.APIError) as streamed:
            for _ in chunks:
                pass
        assert streamed.value.code == "engine_stalled", streamed.value
        assert time.monotonic() - since < 6  # the 2 s timeout, a look, and a loaded machine's delivery
        thread.join(30)
        assert outcome["error"].status_code == 500 and outcome["error"].code == "engine_stalled"
        assert server.process.wait(15) == 1
        assert gone(core)


def test_a_step_that_never_finishes_is_seen_by_its_heartbeats_and_ends_the_server(tiny_llama, plugin):
    """Every thread of the core runs (no SIGSTOP): the heartbeats keep coming and name the
    step that does not finish; the step timeout then fails the stream and exits non-zero."""
    env, trigger = plugin
    args = (*TINY, "--logits-processors", "test-liveness", "--engine-heartbeat-timeout", "2")
    trigger.unlink(missing_ok=True)
    try:
        with serve(tiny_llama[0], *args, "--engine-step-timeout", "4", api_key=None, env=env) as server:
            core = server.core_pid()
            stream = RawStream(server, max_tokens=300)
            trigger.touch()
            hung = time.monotonic()
            error = wait_health(server, 503, timeout=5).json()["error"]
            assert error["code"] == "engine_unresponsive"
            assert "in one step for" in error["message"] and "heartbeats still come" in error["message"]
            frames = stream.frames()
            assert error_codes(frames) == ["engine_stalled"] and frames[-1] == "[DONE]", frames[-3:]
            assert 3.5 < time.monotonic() - hung < 9  # the 4 s timeout counts from the hung step's start
            assert server.process.wait(15) == 1
            assert gone(core)
    finally:
        trigger.unlink(missing_ok=True)
