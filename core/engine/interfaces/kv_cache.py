"""KVCacheManager: which cache blocks each request owns, and the prefix cache."""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs


@attrs.frozen
class KVCacheGroup:
    """Layers whose caches share one block table per request. A group with a
    ``sliding_window`` needs only the blocks that window still reaches: the manager frees the
    others, leaving the null block in their table entries. Each group has its own block ids
    (its layers' cache tensors hold ``num_blocks`` blocks each).

    (interface v3) A ``state`` group holds fixed-size per-request state (Mamba2 layers' conv and
    SSM state), not pages: a request takes one block of it — its state slot — when it first
    allocates, whatever its length, and keeps it until it is freed (finish or preemption: the
    state is dropped and recomputed). Its blocks are never prefix-cached."""

    layers: tuple[int, ...]
    num_blocks: int
    sliding_window: int | None = None
    state: bool = False


class KVCacheManager(ABC):
    """Constructed with the :class:`engine.config.EngineConfig` and the number of blocks, and,
    for a model whose layers attend differently (sliding-window beside global layers), with
    ``groups=`` (:class:`KVCacheGroup`, full-attention groups first) — only if the class sets
    ``supports_groups``; otherwise the engine refuses such a model with the reason.
    Block 0 is the null block: never handed out, used to pad block tables.

    With groups, ``get_computed_blocks`` returns one entry per cached block, each a tuple of
    that block's id in every group (the null block where a window no longer reaches), and
    ``block_ids`` is the first group's table."""

    supports_groups: ClassVar[bool] = False
    # (interface v3) whether it holds ``state`` groups (one slot per request); a manager without
    # it is never handed one, and a model with state layers is refused with the reason
    supports_state: ClassVar[bool] = False

    def __init__(self, config: Any, num_blocks: int, groups: tuple[KVCacheGroup, ...] | None = None):
        self.config = config
        self.num_blocks = num_blocks
        self.groups = groups or (KVCacheGroup((), num_blocks),)

    @abstractmethod
    def get_computed_blocks(self, request) -> tuple[list[int], int]:
        """Cached blocks matching the request's leading tokens and how many tokens they hold.
        Never the whole sequence: the last token is always computed (it yields logits)."""

    @abstractmethod
    def allocate_slots(
        self,
        request,
        num_new_tokens: int,
        computed_blocks: Sequence[int] = (),
        num_lookahead_tokens: int = 0,
        watermark: bool = False,
        delay_cache: bool = False,
    ) -> bool:
        """Own blocks for ``num_new_tokens`` more tokens (plus draft lookahead) after
        taking ``computed_blocks``. False, changing nothing, when blocks run out.
        ``delay_cache``: enter none of the new full blocks in the prefix cache yet (a KV connector
        fills them, and the load may fail); the next call for the request enters them."""

    @abstractmethod
    def free(self, request) -> None:
        """Release the request's blocks; cached ones stay reusable until evicted."""

    @abstractmethod
    def block_ids(self, request) -> list[int]:
        """The request's block table (the first group's)."""

    def group_block_ids(self, request) -> list[list[int]]:
        """The request's block table in each group."""
        return [self.block_ids(request)]

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes; False when blocks are still in use."""

    def take_events(self) -> list:
        """The KV events (:mod:`engine.messages.kv_events`) recorded since the last call, oldest first.
        A manager records them when ``config.kv_events_config`` asks for them (its
        ``publishing``); one that does not record returns none (the default)."""
        return []

    @property
    @abstractmethod
    def usage(self) -> float:
        """Fraction of blocks in use (0..1)."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int: ...

    @property
    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters: ``prefix_queries`` and ``prefix_hits`` (tokens)."""
