"""Default KV cache manager: a fixed block pool with prefix caching by chained hashes.

A block's hash covers its parent's hash, its token ids and the request's extra keys
(cache salt), so equal hashes mean equal whole prefixes. Freed blocks keep their hash
and stay reusable until the pool evicts them, oldest-freed first; a request's blocks
are freed tail first, so the shared head of a prefix outlives its private tail.

KV cache groups (a model with sliding-window layers) each have a pool of their own; one
allocation takes blocks in every group or in none. A sliding-window group frees the blocks its
window no longer reaches as the request advances (their table entries become the null block);
they keep their hash in the free queue like any freed block. A prefix hit is the longest run of
cached blocks that every full group holds whole and every sliding group holds within the window
of the first token to compute (the blocks before it are not needed), so a hit never lacks K/V a
query will read.

A state group (Mamba2 layers' per-request state, interface v3) gives each request one block,
its state slot, at its first allocation and takes it back when the request is freed. A state
is not kept at block boundaries, so a manager holding a state group finds no prefix hits (the
engine turns prefix caching off for such a model and says why).

With ``kv_events_config`` enabled the manager records KV events (:mod:`engine.messages.kv_events`) for
the first group's pool — the blocks a prefix is looked up by: ``BlockStored`` when full blocks
get their hash, ``BlockRemoved`` when a hashed block is evicted for reuse, ``AllBlocksCleared``
on a reset.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.interfaces import KVCacheGroup, KVCacheManager
from engine.messages.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, block_hashes

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, events: list | None = None):
        self.events = events  # BlockRemoved of evicted hashed blocks go here (None: not recorded)
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[bytes, int] = {}

    def take(self, n: int) -> list[int]:
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._evict(block)
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks) -> None:
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self.free[block]
            self.ref_cnt[block] += 1

    def release(self, blocks) -> None:
        for block in reversed(blocks):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free[block] = None

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
                if self.events is not None:
                    self.events.append(BlockRemoved((h,)))
            self.block_hash[block] = None


class _GroupState:
    """One group's pool and each request's table in it."""

    def __init__(self, group: KVCacheGroup, block_size: int, watermark: float, events: list | None = None):
        self.window = group.sliding_window
        self.state = group.state
        self.block_size = block_size
        self.num_blocks = group.num_blocks
        self.pool = BlockPool(group.num_blocks, events)
        self.watermark_blocks = int(watermark * group.num_blocks)
        self.tables: dict[str, list[int]] = {}
        self.peak = self.freed_by_window = 0

    def first_needed(self, num_computed: int) -> int:
        """Index of the first block a query at position ``num_computed`` or later reads."""
        return 0 if self.window is None else max(0, num_computed - self.window + 1) // self.block_size

    def out_of_window(self, table: list[int], num_computed: int) -> list[int]:
        return [b for b in table[: self.first_needed(num_computed)] if b != NULL_BLOCK]

    def shortfall(
        self, table: list[int], computed: list[int], num_computed: int, total: int, watermark: bool
    ) -> tuple[int, bool]:
        """(blocks to take, whether the pool can give them with those it may free now)."""
        if self.state:  # one slot per request, whatever its length
            needed = 0 if table else 1
        else:
            needed = max(0, -(-total // self.block_size) - len(table) - len(computed))
        revived = sum(1 for b in computed if b != NULL_BLOCK and self.pool.ref_cnt[b] == 0)
        released = sum(1 for b in self.out_of_window(table, num_computed) if self.pool.ref_cnt[b] == 1)
        reserve = self.watermark_blocks if watermark else 0
        return needed, needed + revived <= len(self.pool.free) + released - reserve

    def extend(self, rid: str, computed: list[int], needed: int, num_computed: int) -> list[int]:
        table = self.tables.setdefault(rid, [])
        self.pool.touch([b for b in computed if b != NULL_BLOCK])
        table.extend(computed)
        dropped = self.out_of_window(table, num_computed)
        if dropped:
            self.pool.release(dropped[::-1])  # oldest first into the free queue
            self.freed_by_window += len(dropped)
            table[: self.first_needed(num_computed)] = [NULL_BLOCK] * self.first_needed(num_computed)
        table.extend(self.pool.take(needed))
        self.peak = max(self.peak, self.num_blocks - 1 - len(self.pool.free))
        return table

    def cache(self, table: list[int], hashes: list[bytes], start: int, end: int) -> list[int]:
        """Enter blocks start..end of a table; -> the indices of those that became the cached
        block of their hash."""
        stored: list[int] = []
        if self.state:
            return stored
        for index, (block, h) in enumerate(zip(table[start:end], hashes[start:end]), start):
            if block != NULL_BLOCK and self.pool.block_hash[block] is None:
                self.pool.block_hash[block] = h
                if self.pool.cached.setdefault(h, block) == block:
                    stored.append(index)
        return stored

    def free(self, rid: str) -> None:
        self.pool.release([b for b in self.tables.pop(rid, []) if b != NULL_BLOCK])

    def hit(self, hashes: list[bytes], num_blocks: int) -> list[int] | None:
        """This group's blocks for a hit of ``num_blocks`` blocks (the null block before the
        window), or None when it lacks one."""
        first = self.first_needed(num_blocks * self.block_size)
        blocks = [self.pool.cached.get(h) for h in hashes[first:num_blocks]]
        return None if None in blocks else [NULL_BLOCK] * first + blocks


class PrefixCachingKVCacheManager(KVCacheManager):
    supports_groups = True
    supports_state = True

    def __init__(self, config, num_blocks: int, groups: tuple[KVCacheGroup, ...] | None = None):
        super().__init__(config, num_blocks, groups)
        self.block_size = config.cache.block_size
        self.caching = config.cache.enable_prefix_caching and not any(g.state for g in self.groups)
        events = getattr(config, "kv_events_config", None)
        self._events: list | None = [] if self.caching and events is not None and events.publishing else None
        self._groups = [
            _GroupState(g, self.block_size, config.cache.watermark, self._events if i == 0 else None)
            for i, g in enumerate(self.groups)
        ]
        self._requests: set[str] = set()
        self._num_hashed: dict[str, int] = {}  # leading blocks of a request already in the cache
        self._queries = self._hits = 0

    def _hashes(self, request) -> list[bytes]:
        return block_hashes(request, self.block_size)

    def get_computed_blocks(self, request) -> tuple[list, int]:
        if not self.caching:
            return [], 0
        hashes = self._hashes(request)[: (request.num_tokens - 1) // self.block_size]
        longest = len(hashes)
        for group in self._groups:
            if group.window is None:
                longest = next(
                    (i for i, h in enumerate(hashes[:longest]) if h not in group.pool.cached), longest
                )
        for n in range(longest, 0, -1):
            per_group = [g.hit(hashes, n) for g in self._groups]
            if None not in per_group:
                blocks = per_group[0] if len(per_group) == 1 else list(zip(*per_group))
                return blocks, n * self.block_size
        return [], 0

    def allocate_slots(
        self,
        request,
        num_new_tokens,
        computed_blocks=(),
        num_lookahead_tokens=0,
        watermark=False,
        delay_cache=False,
    ) -> bool:
        rid = request.request_id
        first = rid not in self._requests
        per_group = self._split(computed_blocks)
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens + num_lookahead_tokens
        plans = [
            g.shortfall(g.tables.get(rid, []), computed, num_computed, total, watermark)
            for g, computed in zip(self._groups, per_group)
        ]
        if not all(ok for _, ok in plans):
            return False
        self._requests.add(rid)
        tables = [
            g.extend(rid, computed, needed, num_computed)
            for g, computed, (needed, _) in zip(self._groups, per_group, plans)
        ]
        if first:
            self._queries += request.num_tokens
            self._hits += len(computed_blocks) * self.block_size
        if self.caching and not delay_cache:
            self._cache_full_blocks(request, tables, num_computed + num_new_tokens)
        return True

    def _split(self, computed_blocks) -> list[list[int]]:
        """Computed blocks per group (with groups, each entry holds one block per group)."""
        if len(self._groups) == 1:
            return [list(computed_blocks)]
        return (
            [list(column) for column in zip(*computed_blocks)]
            if computed_blocks
            else [[]] * len(self._groups)
        )

    def _cache_full_blocks(self, request, tables: list[list[int]], num_tokens: int) -> None:
        rid = request.request_id
        start, end = self._num_hashed.get(rid, 0), min(num_tokens, request.num_tokens) // self.block_size
        if end <= start:
            return
        hashes = self._hashes(request)
        for index, (group, table) in enumerate(zip(self._groups, tables)):
            stored = group.cache(table, hashes, start, end)
            if index == 0 and self._events is not None and stored:
                self._record_stored(request, hashes, stored)
        self._num_hashed[rid] = end

    def _record_stored(self, request, hashes: list[bytes], stored: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive newly cached blocks."""
        bs, runs = self.block_size, [[stored[0]]]
        for index in stored[1:]:
            if index == runs[-1][-1] + 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            tokens = request.all_token_ids[run[0] * bs : (run[-1] + 1) * bs]
            self._events.append(
                BlockStored(
                    tuple(hashes[i] for i in run),
                    hashes[run[0] - 1] if run[0] else None,
                    tuple(tokens),
                    bs,
                    request.lora_id,
                )
            )

    def free(self, request) -> None:
        self._num_hashed.pop(request.request_id, None)
        self._requests.discard(request.request_id)
        for group in self._groups:
            group.free(request.request_id)

    def block_ids(self, request) -> list[int]:
        return self._groups[0].tables.get(request.request_id, [])

    def group_block_ids(self, request) -> list[list[int]]:
        return [g.tables.get(request.request_id, []) for g in self._groups]

    def reset_prefix_cache(self) -> bool:
        if any(any(g.tables.values()) for g in self._groups):
            return False
        for group in self._groups:
            group.pool.cached.clear()
            group.pool.block_hash = [None] * group.num_blocks
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list:
        if not self._events:
            return []
        events = list(self._events)
        self._events.clear()  # the list the first pool appends to stays the same object
        return events

    @property
    def usage(self) -> float:
        """The fullest group's share of its blocks in use."""
        return max(1.0 - len(g.pool.free) / (g.num_blocks - 1) for g in self._groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(len(g.pool.free) for g in self._groups)

    def peak_blocks_in_use(self) -> list[int]:
        """Per group, the most blocks in use at once so far."""
        return [g.peak for g in self._groups]

    @property
    def stats(self) -> dict[str, int]:
        """``prefix_queries`` and ``prefix_hits`` (tokens), and ``window_freed_blocks``: blocks
        freed because every window had passed them."""
        return {
            "prefix_queries": self._queries,
            "prefix_hits": self._hits,
            "window_freed_blocks": sum(g.freed_by_window for g in self._groups),
        }
