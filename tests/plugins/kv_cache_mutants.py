"""Planted bugs: the built-in KV cache manager with one mistake each, the mistakes KV cache
manager authors make. Not registered by the suite's conftest: ``tests/test_kv_cache_kit_mutations.py``
registers them in a child pytest that runs the KV cache manager kit on each, and checks that it
fails."""

from __future__ import annotations

from engine import hookimpl
from engine.builtin.kv_cache_manager import BlockPool, PrefixCachingKVCacheManager, _GroupState
from engine.messages.kv_events import chain_hashes


class NoRollback(PrefixCachingKVCacheManager):
    """Takes blocks as it goes and, when the pool runs dry part way, returns False keeping them."""

    def allocate_slots(self, request, num_new_tokens, computed_blocks=(), num_lookahead_tokens=0, **options):
        if super().allocate_slots(request, num_new_tokens, computed_blocks, num_lookahead_tokens, **options):
            return True
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens + num_lookahead_tokens
        for group, computed in zip(self._groups, self._split(computed_blocks)):
            table = group.tables.setdefault(request.request_id, [])
            needed, _ = group.shortfall(table, computed, num_computed, total, False)
            table.extend(group.pool.take(min(needed, len(group.pool.free))))
        return False


class CountlessPool(BlockPool):
    """Puts every released block back in the free queue, whoever else holds it."""

    def release(self, blocks) -> None:
        for block in reversed(blocks):
            self.ref_cnt[block] = 0
            self.free[block] = None


class FreesSharedBlocks(PrefixCachingKVCacheManager):
    """Frees all of a request's blocks, also those a request that hit its prefix still holds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for group in self._groups:  # the built-in builds its pools itself
            group.pool.__class__ = CountlessPool


class HashIgnoresParent(PrefixCachingKVCacheManager):
    """Hashes each block's own tokens (and the cache salt), not the prefix before them."""

    def _hashes(self, request) -> list[bytes]:
        bs, tokens = self.block_size, request.all_token_ids
        return [
            chain_hashes(tokens[start : start + bs], bs, request.cache_salt)[0]
            for start in range(0, request.num_tokens - bs + 1, bs)
        ]


class CachesUncomputedBlocks(PrefixCachingKVCacheManager):
    """Caches every full block of the known tokens, also those the chunk has not computed yet."""

    def _cache_full_blocks(self, request, tables, num_tokens) -> None:
        super()._cache_full_blocks(request, tables, request.num_tokens)


class EagerWindowGroup(_GroupState):
    """Rounds the first block a query reads up, not down."""

    def first_needed(self, num_computed: int) -> int:
        return 0 if self.window is None else -(-max(0, num_computed - self.window + 1) // self.block_size)


class WindowDropsReadBlocks(PrefixCachingKVCacheManager):
    """Frees a sliding-window block once the window starts past its first token, not its last."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for group in self._groups:
            group.__class__ = EagerWindowGroup  # the built-in builds its groups itself


class KeepingGroup(_GroupState):
    """Reads every block from the first, whatever its window."""

    def first_needed(self, num_computed: int) -> int:
        return 0


class WindowKeepsPassedBlocks(PrefixCachingKVCacheManager):
    """Holds a sliding-window group's blocks like a full-attention group's: none is ever passed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for group in self._groups:
            group.__class__ = KeepingGroup  # the built-in builds its groups itself


MUTANTS = {
    "no-rollback": NoRollback,
    "frees-shared-blocks": FreesSharedBlocks,
    "hash-ignores-parent": HashIgnoresParent,
    "caches-uncomputed-blocks": CachesUncomputedBlocks,
    "window-drops-read-blocks": WindowDropsReadBlocks,
    "window-keeps-passed-blocks": WindowKeepsPassedBlocks,
}


@hookimpl
def register_kv_cache_managers(register):
    for name, manager in MUTANTS.items():
        register(name, manager, api=2)
