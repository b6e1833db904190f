"""KV cache manager contract: random workloads (hypothesis) of requests with shared
prefixes that grow, hit the prefix cache and are freed. Checked after every operation:
no block leaked, double-owned or handed out as the null block; a failed allocation
changes nothing; and every prefix-cache hit returns blocks whose written contents are
exactly the request's tokens, each written after the same whole prefix (a slot's K/V depends
on every token before it). With KV cache groups (a full-attention group beside a
sliding-window one) the same holds in every group, and a sliding-window group holds exactly
the blocks its window still reaches (its table entries before them, and a hit's, are the null
block). A manager that publishes KV events reports a consistent stream: a block is stored once
until removed, removed only once stored, and a reset clears everything. Beside the random
workloads, one small test per bug manager authors make: a failed allocation that keeps what it
took, a block freed while another request's prefix hit holds it, a hash of a block's own tokens
only, a block cached before it is computed, a window that drops a block it still reads or keeps
one it passed."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.interfaces import KVCacheGroup
from engine.messages.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.messages.request import Request
from engine.messages.sampling_params import SamplingParams
from engine.plugins import load_plugins

BLOCK = 4
WINDOW = 6
MAX_CHUNK = 9  # the most tokens a new request's first allocation asks for


def _first_in_window(window: int | None, num_computed: int) -> int:
    """Index of the first block a query at ``num_computed`` or later reads."""
    return 0 if window is None else max(0, num_computed - window + 1) // BLOCK


def _written(request: Request, pos: int) -> tuple[int, ...]:
    """What the slot of position ``pos`` holds once computed: its token's K/V, which attention
    computed from every token up to it, so the model records that whole prefix."""
    return tuple(request.all_token_ids[: pos + 1])


class _Sim:
    """Drives a manager like the scheduler does and records what each group's blocks hold."""

    def __init__(self, manager, num_blocks, windows=(None,)):
        self.kv, self.num_blocks, self.windows = manager, num_blocks, windows
        self.live: dict[str, Request] = {}
        self.content = [{} for _ in windows]  # per group: block -> offset -> what its slot holds
        self.allocated_at: dict[str, int] = {}  # tokens computed at a request's last allocation

    def admit(self, request: Request, chunk: int) -> bool:
        blocks, cached = self.kv.get_computed_blocks(request)
        assert cached == len(blocks) * BLOCK and cached < request.num_tokens
        for i, entry in enumerate(blocks):
            want = {o: _written(request, i * BLOCK + o) for o in range(BLOCK)}
            for group, block in enumerate(entry if len(self.windows) > 1 else (entry,)):
                if i < _first_in_window(self.windows[group], cached):
                    assert block == 0, "a hit holds a block its window has passed"
                else:
                    assert self.content[group].get(block) == want, (
                        "prefix-cache hit returned a block with other contents"
                    )
        chunk = min(chunk, request.num_tokens - cached)
        if not self._allocate(request, chunk, blocks):
            return False
        request.num_computed_tokens = cached
        self._write(request, chunk)
        self.live[request.request_id] = request
        return True

    def grow(self, request: Request, new_tokens: list[int]) -> None:
        for t in new_tokens:
            request.append_output(t)
        chunk = request.num_tokens - request.num_computed_tokens
        if self._allocate(request, chunk, ()):
            self._write(request, chunk)

    def _allocate(self, request, chunk, blocks) -> bool:
        before = ([list(t) for t in self.kv.group_block_ids(request)], self.kv.num_free_blocks)
        ok = self.kv.allocate_slots(request, chunk, blocks)
        if ok:
            self.allocated_at[request.request_id] = request.num_computed_tokens + len(blocks) * BLOCK
        else:
            assert ([list(t) for t in self.kv.group_block_ids(request)], self.kv.num_free_blocks) == before, (
                "a failed allocation must change nothing"
            )
        return ok

    def _write(self, request, chunk) -> None:
        for content, table in zip(self.content, self.kv.group_block_ids(request)):
            assert len(table) * BLOCK >= request.num_computed_tokens + chunk
            for pos in range(request.num_computed_tokens, request.num_computed_tokens + chunk):
                assert table[pos // BLOCK] != 0, "a token to write has no block"
                content.setdefault(table[pos // BLOCK], {})[pos % BLOCK] = _written(request, pos)
        request.num_computed_tokens += chunk

    def free(self, rid: str) -> None:
        self.kv.free(self.live.pop(rid))

    def check(self) -> None:
        num_owned = 0
        for group, window in enumerate(self.windows):
            num_owned += len(self._check_group(group, window))
        assert self.kv.num_free_blocks + num_owned == len(self.windows) * (self.num_blocks - 1), (
            "blocks leaked"
        )

    def _check_group(self, group: int, window: int | None) -> dict[int, list]:
        owned: dict[int, list] = {}
        for request in self.live.values():
            table = self.kv.group_block_ids(request)[group]
            held = [(i, b) for i, b in enumerate(table) if b != 0]
            passed = _first_in_window(window, self.allocated_at[request.request_id])
            assert all(i >= passed for i, _ in held), "a block the window has passed is kept"
            assert [i for i, _ in held] == list(range(passed, len(table))), (
                "the null block was handed out, or a block the window still reaches was dropped"
            )
            assert len({b for _, b in held}) == len(held)
            for i, block in held:
                owned.setdefault(block, []).append((request, i))
        for block, owners in owned.items():
            if len(owners) > 1:  # sharing is only legal for identical full prefix blocks
                prefixes = {tuple(r.all_token_ids[: (i + 1) * BLOCK]) for r, i in owners}
                assert len(prefixes) == 1 and all(r.num_computed_tokens >= (i + 1) * BLOCK for r, i in owners)
        return owned


class _EventCheck:
    """Plays a manager's KV events onto ``held`` (the hashes it reports cached), checking each."""

    def __init__(self, manager, held: set):
        self.kv, self.held, self.seen = manager, held, 0

    def __call__(self) -> None:
        for event in self.kv.take_events():
            self.seen += 1
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == BLOCK * len(event.block_hashes) and event.block_size == BLOCK
                assert not self.held & set(event.block_hashes), "a block stored twice without its removal"
                self.held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.held, "a block removed that was never stored"
                self.held.difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.held.clear()


# one contract class per manager (a plugin's, the built-in's) runs the same methods; each class's
# examples are deterministic in its own attributes, so hypothesis' differing-executors check is off
ONE_CLASS_EACH = [HealthCheck.differing_executors]
operations = st.lists(
    st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 10**6)), min_size=1, max_size=40
)


class KVCacheManagerContract:
    manager_name = "default"

    def make(self, num_blocks: int, caching: bool = True, windows=(None,), events: bool = False):
        config = EngineConfig.from_kwargs(
            block_size=BLOCK,
            enable_prefix_caching=caching,
            kv_events_config={"enable_kv_cache_events": True} if events else None,
        )
        cls = load_plugins().get("kv_cache_managers", self.manager_name)
        if windows == (None,):
            return cls(config, num_blocks)
        if not cls.supports_groups:
            pytest.skip(f"{self.manager_name} does not hold KV cache groups")
        groups = tuple(KVCacheGroup((i,), num_blocks, w) for i, w in enumerate(windows))
        return cls(config, num_blocks, groups=groups)

    @settings(max_examples=60, deadline=None, suppress_health_check=ONE_CLASS_EACH)
    @given(ops=operations, num_blocks=st.integers(4, 24), caching=st.booleans())
    def test_random_workload_accounting(self, ops, num_blocks, caching):
        self._run_workload(_Sim(self.make(num_blocks, caching), num_blocks), ops)

    @settings(max_examples=60, deadline=None, suppress_health_check=ONE_CLASS_EACH)
    @given(ops=operations, num_blocks=st.integers(4, 24), caching=st.booleans())
    def test_random_workload_with_a_sliding_window_group(self, ops, num_blocks, caching):
        windows = (None, WINDOW)
        self._run_workload(_Sim(self.make(num_blocks, caching, windows), num_blocks, windows), ops)

    @settings(max_examples=40, deadline=None, suppress_health_check=ONE_CLASS_EACH)
    @given(ops=operations, num_blocks=st.integers(4, 24))
    def test_kv_events_tell_what_the_cache_holds(self, ops, num_blocks):
        sim = _Sim(self.make(num_blocks, events=True), num_blocks)
        held: set = set()
        check = _EventCheck(sim.kv, held)
        self._run_workload(sim, ops, after_each=check)
        assert sim.kv.reset_prefix_cache()
        check()
        assert not held, "AllBlocksCleared must follow a reset"
        if not check.seen:
            pytest.skip(f"{self.manager_name} publishes no KV events")

    @staticmethod
    def _run_workload(sim: _Sim, ops, after_each=lambda: None) -> None:
        prefixes = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], [1, 2, 3, 4, 7, 7, 7, 7]]
        for n, (op, r) in enumerate(ops):
            if op == "add" or not sim.live:
                prompt = prefixes[r % 3] + [r % 5 + 1] * (r % 7)
                request = Request(f"r{n}", prompt, SamplingParams())
                sim.admit(request, chunk=1 + r % MAX_CHUNK)
            elif op == "grow":
                request = list(sim.live.values())[r % len(sim.live)]
                sim.grow(request, [r % 11 + 1] * (1 + r % 3))
            else:
                sim.free(list(sim.live)[r % len(sim.live)])
            sim.check()
            after_each()
        for rid in list(sim.live):
            sim.free(rid)
        sim.check()
        assert sim.kv.usage == 0.0

    def test_prefix_hits_are_counted_and_reset(self):
        sim = _Sim(self.make(16), 16)
        first = Request("a", list(range(1, 11)), SamplingParams())
        assert sim.admit(first, chunk=10)
        sim.free("a")
        second = Request("b", list(range(1, 11)) + [42], SamplingParams())
        blocks, cached = sim.kv.get_computed_blocks(second)
        assert cached == 8 and len(blocks) == 2
        assert sim.admit(second, chunk=11)
        assert sim.kv.stats["prefix_hits"] == 8
        assert not sim.kv.reset_prefix_cache(), "reset must refuse while blocks are in use"
        sim.free("b")
        assert sim.kv.reset_prefix_cache()
        assert sim.kv.get_computed_blocks(Request("c", list(range(1, 11)), SamplingParams())) == ([], 0)

    def test_cache_salt_isolates_prefixes(self):
        sim = _Sim(self.make(16), 16)
        assert sim.admit(Request("a", list(range(1, 11)), SamplingParams(), cache_salt="tenant-1"), chunk=10)
        other = Request("b", list(range(1, 11)), SamplingParams(), cache_salt="tenant-2")
        assert sim.kv.get_computed_blocks(other) == ([], 0)
        same = Request("c", list(range(1, 11)), SamplingParams(), cache_salt="tenant-1")
        assert sim.kv.get_computed_blocks(same)[1] == 8

    # one test per bug manager authors make (tests/test_kv_cache_kit_mutations.py plants each)
    def test_a_failed_allocation_keeps_nothing_it_took(self):
        sim = _Sim(self.make(6), 6)
        assert sim.admit(Request("a", list(range(1, 9)), SamplingParams()), chunk=8)
        assert not sim.admit(Request("b", list(range(20, 36)), SamplingParams()), chunk=16)
        sim.check()

    def test_a_block_stays_while_another_request_holds_it(self):
        """The first owner of a prefix is freed while a request that hit it still reads it."""
        sim = _Sim(self.make(16), 16)
        assert sim.admit(Request("a", list(range(1, 11)), SamplingParams()), chunk=10)
        assert sim.admit(Request("b", list(range(1, 11)) + [42], SamplingParams()), chunk=11)
        sim.free("a")
        sim.check()
        assert sim.admit(Request("c", list(range(50, 80)), SamplingParams()), chunk=9)
        sim.check()

    def test_equal_blocks_after_different_prefixes_do_not_hit(self):
        """``b`` starts with the block ``a`` has second, and repeats it: neither is a hit."""
        sim = _Sim(self.make(16), 16)
        assert sim.admit(Request("a", [9, 9, 9, 9, 1, 2, 3, 4, 5], SamplingParams()), chunk=9)
        assert sim.admit(Request("b", [1, 2, 3, 4, 1, 2, 3, 4, 5], SamplingParams()), chunk=9)
        sim.check()

    def test_blocks_a_chunk_has_not_computed_do_not_hit(self):
        """``a`` computes 6 of its 10 tokens: its second block is not written yet."""
        sim = _Sim(self.make(16), 16)
        assert sim.admit(Request("a", list(range(1, 11)), SamplingParams()), chunk=6)
        assert sim.admit(Request("b", list(range(1, 12)), SamplingParams()), chunk=9)
        sim.check()

    def test_a_sliding_window_drops_exactly_the_blocks_it_passed(self):
        """Computing from position 10, the window (6) reads from position 5: block 1 on."""
        windows = (None, WINDOW)
        sim = _Sim(self.make(16, windows=windows), 16, windows)
        request = Request("a", list(range(1, 15)), SamplingParams())
        assert sim.admit(request, chunk=10)
        sim.grow(request, [7])
        sim.check()
        sim.free("a")
        again = Request("b", list(range(1, 15)) + [7, 8], SamplingParams())
        assert sim.admit(again, chunk=2)
        sim.check()

    def test_a_state_group_gives_each_request_one_slot(self):
        """(interface v3) Beside a paged group, a state group of 4 blocks (3 slots and the null
        block): each request holds one slot of its own whatever its length, a fourth waits
        without taking pages, a freed request's slot serves the next, and nothing hits the prefix
        cache (a state is not kept per block)."""
        cls = load_plugins().get("kv_cache_managers", self.manager_name)
        if not getattr(cls, "supports_state", False):
            pytest.skip(f"{self.manager_name} does not hold state groups")
        config = EngineConfig.from_kwargs(block_size=BLOCK, enable_prefix_caching=True)
        kv = cls(config, 16, groups=(KVCacheGroup((0,), 16), KVCacheGroup((1,), 4, state=True)))
        requests = [Request(f"r{i}", list(range(1, 2 + 5 * i)), SamplingParams()) for i in range(4)]
        for request in requests[:3]:
            assert kv.allocate_slots(request, request.num_tokens)
            request.num_computed_tokens = request.num_tokens
            assert kv.allocate_slots(request, 1)  # a decode step keeps the one slot
        slots = [kv.group_block_ids(r)[1] for r in requests[:3]]
        assert all(len(s) == 1 and s[0] != 0 for s in slots) and len({s[0] for s in slots}) == 3, slots
        assert not kv.allocate_slots(requests[3], requests[3].num_tokens)
        assert kv.group_block_ids(requests[3]) == [[], []], "a failed allocation keeps nothing"
        kv.free(requests[0])
        assert kv.allocate_slots(requests[3], requests[3].num_tokens)
        assert kv.group_block_ids(requests[3])[1] == slots[0]
        again = Request("again", list(requests[1].all_token_ids) + [3], SamplingParams())
        assert kv.get_computed_blocks(again) == ([], 0)
