"""P/D connector contract: :class:`~engine.testing.kv_connector.KVConnectorContract` run through a
prefill instance and a decode instance (two engines' schedulers, KV pools, caches and connector
halves in one process, their transports talking over real sockets).

Every request a test adds is first prefilled on the producer (``max_tokens=1``,
``kv_transfer_params={"do_remote_decode": true}``, vLLM's proxy flow); the params its last output
carries are given to the request, which then runs on the consumer: its prompt blocks are pulled
into the consumer's own (other) block ids. So every check of the contract holds across instances:
each block a request computes on holds exactly its prefix's values (the round trip through the
transport is exact), failed loads recompute to the same output, preemption and aborts leak no
block on either side. The tests here add what only P/D has: the producer frees a request's blocks
as soon as the decode side pulled them (not when its timeout runs out), and so does a request
aborted on the decode side before its pull, or one never sent there; params of another prompt
are not pulled; a dead producer fails the pull and the request recomputes. Transfers take real
time, so a run fails after ``STALL_SECONDS`` in which neither instance computed anything or freed a
block (the plain contract's ``stall_steps``, in seconds), and a failing random workload is reported
as found, not shrunk.

For connectors built on :class:`engine.kv_transfer.PDConnector`; a plugin's test subclasses
:class:`PDConnectorContract` and sets ``connector_name``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from engine.kv_transfer import DO_REMOTE_DECODE
from engine.messages.request import Request
from engine.messages.sampling_params import SamplingParams
from engine.testing.kv_connector import BLOCK, RANDOM_WORKLOADS, ConnectorSim, KVConnectorContract
from engine.testing.ports import free_port
from engine.testing.scheduler import alone

RUN_SECONDS = 120  # a workload's bound: transfers are real, so time (not steps) bounds it
TRANSFER_TIMEOUT = 10  # seconds: a read lands or fails within it
STALL_SECONDS = 2 * TRANSFER_TIMEOUT  # nothing computed and no block freed for this long: a run fails


@attrs.define
class PDSim(ConnectorSim):
    """The decode instance (what the contract's checks look at), with its prefill instance."""

    producer: ConnectorSim = attrs.field(kw_only=True)
    handed_on: dict = attrs.Factory(dict)  # request id -> the producer's kv_transfer_params (or None)

    def prefill(self, request: Request) -> dict | None:
        """Run the request's prompt on the producer; the params its last output hands on."""
        self.producer.add(
            Request(
                request.request_id,
                request.prompt_token_ids,
                SamplingParams(max_tokens=1),
                kv_transfer_params={DO_REMOTE_DECODE: True},
            )
        )
        self._step_until(lambda: request.request_id in self.handed_on, f"prefilling {request.request_id}")
        return self.handed_on.pop(request.request_id)

    def add(self, request: Request) -> None:
        request.kv_transfer_params = self.prefill(request)
        super().add(request)

    def add_local(self, request: Request) -> None:
        """A request the decode instance computes itself."""
        super().add(request)

    def step(self) -> list:
        for out in self.producer.step():
            if out.finished:
                self.handed_on[out.request_id] = out.kv_transfer_params
        outputs = super().step()
        if not (self.last_computed or self.producer.last_computed):
            time.sleep(0.0005)  # only transfers are waited on: let the transport threads run
        return outputs

    def drained(self) -> bool:
        return super().drained() and self.producer.drained()

    def run(self, max_steps: int = 0, abort_at: dict[int, str] | None = None) -> None:
        self._step_until(self.drained, "running the requests", abort_at)

    def _step_until(
        self, done: Callable[[], bool], what: str, abort_at: dict[int, str] | None = None
    ) -> None:
        """Step until ``done()``; fail after ``STALL_SECONDS`` in which neither instance computed
        anything or freed a block (every wait is a transfer, which ends within
        ``TRANSFER_TIMEOUT``, and a release frees a producer's blocks at once), else at
        ``RUN_SECONDS``."""
        started = progressed = time.monotonic()
        while time.monotonic() - started < RUN_SECONDS:
            if abort_at and self.steps in abort_at:
                self.path.abort([abort_at[self.steps]])
            if done():
                return
            free = self._free_blocks()
            self.step()
            if self.last_computed or self.producer.last_computed or self._free_blocks() != free:
                progressed = time.monotonic()
            elif time.monotonic() - progressed > STALL_SECONDS:
                raise AssertionError(
                    f"{what}: for {STALL_SECONDS} s neither instance computed anything or freed a block"
                    " (requests wait for blocks nothing will free, or a connector holds blocks forever)"
                )
        raise AssertionError(f"{what}: not done within {RUN_SECONDS} s")

    def _free_blocks(self) -> tuple[int, int]:
        return self.kv.num_free_blocks, self.producer.kv.num_free_blocks

    def close(self) -> None:
        super().close()
        self.producer.close()


class PDConnectorContract(KVConnectorContract):
    abort_request_timeout = 60.0  # seconds; the tests that need a timeout set their own

    @pytest.fixture(autouse=True)
    def _close_sims(self):
        self._sim = None
        yield
        if self._sim is not None:
            self._sim.close()

    def extra_config(self, folder: str) -> dict:
        return {"abort_request_timeout": self.abort_request_timeout, "transfer_timeout": TRANSFER_TIMEOUT}

    def make(
        self,
        folder: str,
        num_blocks: int = 16,
        budget: int = 16,
        max_num_seqs: int = 4,
        fail_every: int = 0,
        **extra,
    ) -> PDSim:
        if self._sim is not None:  # one pair at a time (a hypothesis example each)
            self._sim.close()
        config = {
            "kv_connector": self.connector_name,
            "kv_ip": "127.0.0.1",
            "kv_connector_extra_config": {**self.extra_config(folder), **extra},
        }
        producer = self._producer(config, num_blocks + 4, budget, max_num_seqs)
        producer.add(Request("warm-up", [96] * (3 * BLOCK), SamplingParams(max_tokens=1)))
        producer.run()  # its free queue now starts elsewhere than the consumer's: other block ids
        consumer = self.make_sim(
            {**config, "kv_role": "kv_consumer", "kv_port": 0}, num_blocks, budget, max_num_seqs, fail_every
        )
        self._sim = PDSim(**attrs.asdict(consumer, recurse=False), producer=producer)
        return self._sim

    def _producer(self, config: dict, *args) -> ConnectorSim:
        """The prefill side on a free port; another port when the chosen one was taken first."""

        def attempt() -> ConnectorSim:
            return self.make_sim({**config, "kv_role": "kv_producer", "kv_port": free_port()}, *args)

        for _ in range(4):
            try:
                return attempt()
            except ValueError as error:
                if "cannot listen" not in str(error):
                    raise
        return attempt()

    def assert_other_blocks(self, request, loaded_into, held_before):
        """The values came from the producer's blocks, which are other ids than the consumer's."""
        assert loaded_into != request.kv_transfer_params["remote_block_ids"][: len(loaded_into)], (
            "the test meant other block ids on each side"
        )

    @settings(
        max_examples=25,
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.differing_executors],
    )
    @given(**RANDOM_WORKLOADS)
    # r0 grows until it preempts itself while r1, whose pull ended, holds 6 of the 13 blocks behind it
    @example(workload=[(1, 14, 8), (0, 14, 2)], aborts=[], fail_every=0)
    def test_random_workloads_leak_no_blocks(self, workload, aborts, fail_every):
        """The plain contract's random workloads, a failing example reported as found: not shrunk
        or explained (each run of one moves real transfers and may take ``STALL_SECONDS`` to
        fail, and a shrink traced line by line once held the suite for over 15 minutes). The
        explicit example is the one a scheduler stalled on: a preempted request queued ahead of
        one holding blocks its finished pull filled, with nothing running to free any."""
        self.check_random_workload(workload, aborts, fail_every)

    # -- what only P/D has -------------------------------------------------------------------
    def test_blocks_land_in_other_block_ids(self, tmp_path):
        sim = self.make(str(tmp_path), num_blocks=32)
        sim.add_local(Request("local", [(3 * j + 1) % 97 for j in range(20)], SamplingParams(max_tokens=2)))
        sim.step()  # the decode instance's pool starts elsewhere than the prefill instance's
        prompt = [(7 * j + 5) % 97 for j in range(22)]
        request = Request("pd", prompt, SamplingParams(max_tokens=6))
        sim.add(request)
        remote = request.kv_transfer_params["remote_block_ids"]
        sim.step()
        local = list(sim.kv.block_ids(request))
        assert local[:5] != remote[:5], "the test meant other block ids on each side"
        sim.run()
        assert sim.stats["external_prefix_hits"] == 20  # 5 full blocks before the last token
        assert request.output_token_ids == alone(prompt, 6)

    def test_the_producer_frees_the_blocks_once_they_are_pulled(self, tmp_path):
        timeout = 6.0  # short, so that blocks freed by it alone fail in seconds
        sim = self.make(str(tmp_path), abort_request_timeout=timeout)
        prompt = [(23 * j + 9) % 97 for j in range(18)]
        request = Request("pulled", prompt, SamplingParams(max_tokens=3))
        sim.add(request)
        assert not sim.producer.drained(), "the producer holds the blocks until they are pulled"
        started = time.monotonic()
        while not sim.producer.drained():
            assert time.monotonic() - started < timeout / 2, (
                "the producer still holds blocks the decode instance pulled: only the timeout frees them"
            )
            sim.step()
        sim.run()
        assert sim.stats["external_prefix_hits"] == 16
        assert request.output_token_ids == alone(prompt, 3)

    def test_abort_before_the_pull_frees_the_producers_blocks(self, tmp_path):
        sim = self.make(str(tmp_path))
        request = Request("gone", [(5 * j + 2) % 97 for j in range(18)], SamplingParams(max_tokens=4))
        sim.add(request)
        assert sim.producer.kv.num_free_blocks < sim.producer.num_blocks - 1, "the producer holds its blocks"
        sim.path.abort(["gone"])  # before the decode instance admitted it
        started = time.monotonic()
        sim.run()
        assert time.monotonic() - started < self.abort_request_timeout / 2, (
            "freed by the release, not the timeout"
        )

    def test_blocks_nobody_reads_are_freed_after_the_timeout(self, tmp_path):
        sim = self.make(str(tmp_path), abort_request_timeout=0.5)
        prompt = [(11 * j + 3) % 97 for j in range(18)]
        stale = sim.prefill(Request("never-read", prompt, SamplingParams(max_tokens=1)))
        assert stale is not None and stale["remote_block_ids"]
        sim.run()  # the producer frees them once the timeout passes
        late = Request("late", prompt, SamplingParams(max_tokens=5), kv_transfer_params=stale)
        sim.add_local(late)  # params of blocks already freed: the pull fails, the prompt is computed
        sim.run()
        assert sim.stats["kv_load_failures"] == 1
        assert late.output_token_ids == alone(prompt, 5)

    def test_params_of_another_prompt_are_not_pulled(self, tmp_path):
        sim = self.make(str(tmp_path))
        prompt = [(19 * j + 4) % 97 for j in range(18)]
        params = sim.prefill(Request("asked", prompt, SamplingParams(max_tokens=1)))
        other = prompt[:10] + [5] * 8  # its fourth block differs: the prefilled blocks are not its K/V
        request = Request("other", other, SamplingParams(max_tokens=4), kv_transfer_params=params)
        sim.add_local(request)
        started = time.monotonic()
        sim.run()
        assert sim.stats["external_prefix_hits"] == 0
        assert request.output_token_ids == alone(other, 4)
        assert time.monotonic() - started < self.abort_request_timeout / 2, "the producer was released"

    def test_an_aborted_prefill_hands_nothing_on(self, tmp_path):
        sim = self.make(str(tmp_path))
        prompt = [(13 * j + 7) % 97 for j in range(40)]
        sim.producer.add(
            Request("cut", prompt, SamplingParams(max_tokens=1), kv_transfer_params={DO_REMOTE_DECODE: True})
        )
        sim.step()  # its first chunk
        sim.producer.path.abort(["cut"])
        sim.step()
        assert "cut" not in sim.handed_on  # an abort is no output: nothing handed on
        assert sim.producer.drained(), "an aborted prefill holds no blocks"

    def test_a_dead_producer_fails_the_pull_and_the_prompt_is_computed(self, tmp_path):
        sim = self.make(str(tmp_path))
        prompt = [(17 * j + 1) % 97 for j in range(21)]
        params = sim.prefill(Request("orphan", prompt, SamplingParams(max_tokens=4)))
        sim.producer.worker.shutdown()  # the prefill instance dies with the blocks
        request = Request("orphan", prompt, SamplingParams(max_tokens=4), kv_transfer_params=params)
        sim.add_local(request)
        started = time.monotonic()
        while not ConnectorSim.drained(sim):
            assert time.monotonic() - started < RUN_SECONDS
            ConnectorSim.step(sim)
            time.sleep(0.0005)
        assert sim.stats["kv_load_failures"] == 1
        assert request.output_token_ids == alone(prompt, 4)
