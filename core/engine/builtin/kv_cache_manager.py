"""Default KV cache manager: a fixed block pool with prefix caching by chained hashes.

A block's hash covers its parent's hash, its token ids and the request's extra keys
(cache salt), so equal hashes mean equal whole prefixes. Freed blocks keep their hash
and stay reusable until the pool evicts them, oldest-freed first; a request's blocks
are freed tail first, so the shared head of a prefix outlives its private tail.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from engine.interfaces import KVCacheManager

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int):
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
            self.block_hash[block] = None


class PrefixCachingKVCacheManager(KVCacheManager):
    def __init__(self, config, num_blocks: int):
        super().__init__(config, num_blocks)
        self.block_size = config.cache.block_size
        self.caching = config.cache.enable_prefix_caching
        self.watermark_blocks = int(config.cache.watermark * num_blocks)
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of a request already in the cache
        self._queries = self._hits = 0

    def _hashes(self, request) -> list[bytes]:
        """Extend ``request.block_hashes`` to every full block of its known tokens."""
        hashes, bs = request.block_hashes, self.block_size
        parent = hashes[-1] if hashes else (request.cache_salt or "").encode()
        for i in range(len(hashes), request.num_tokens // bs):
            tokens = array("q", request.all_token_ids[i * bs:(i + 1) * bs]).tobytes()
            parent = hashlib.sha256(parent + tokens).digest()
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request) -> tuple[list[int], int]:
        if not self.caching:
            return [], 0
        blocks = []
        for h in self._hashes(request)[:(request.num_tokens - 1) // self.block_size]:
            block = self.pool.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(self, request, num_new_tokens, computed_blocks=(), num_lookahead_tokens=0,
                       watermark=False) -> bool:
        rid = request.request_id
        first = rid not in self._blocks
        blocks = self._blocks.get(rid, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens + num_lookahead_tokens
        needed = max(0, -(-total // self.block_size) - len(blocks) - len(computed_blocks))
        revived = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        reserve = self.watermark_blocks if watermark else 0
        if needed + revived > len(self.pool.free) - reserve:
            return False
        self.pool.touch(computed_blocks)
        blocks = self._blocks.setdefault(rid, blocks)
        blocks.extend(computed_blocks)
        blocks.extend(self.pool.take(needed))
        if first:
            self._queries += request.num_tokens
            self._hits += len(computed_blocks) * self.block_size
        if self.caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return True

    def _cache_full_blocks(self, request, blocks: list[int], num_tokens: int) -> None:
        rid = request.request_id
        start, end = self._num_hashed.get(rid, 0), min(num_tokens, request.num_tokens) // self.block_size
        if end <= start:
            return
        hashes = self._hashes(request)
        for block, h in zip(blocks[start:end], hashes[start:end]):
            if self.pool.block_hash[block] is None:
                self.pool.block_hash[block] = h
                self.pool.cached.setdefault(h, block)
        self._num_hashed[rid] = end

    def free(self, request) -> None:
        self._num_hashed.pop(request.request_id, None)
        self.pool.release(self._blocks.pop(request.request_id, []))

    def block_ids(self, request) -> list[int]:
        return self._blocks.get(request.request_id, [])

    def reset_prefix_cache(self) -> bool:
        if any(self._blocks.values()):
            return False
        self.pool.cached.clear()
        self.pool.block_hash = [None] * self.num_blocks
        return True

    @property
    def usage(self) -> float:
        return 1.0 - len(self.pool.free) / (self.num_blocks - 1)

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free)

    @property
    def stats(self) -> dict[str, int]:
        return {"prefix_queries": self._queries, "prefix_hits": self._hits}
