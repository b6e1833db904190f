"""KVCacheManager: which cache blocks each request owns, and the prefix cache."""

from abc import ABC, abstractmethod
from typing import Any


class KVCacheManager(ABC):
    """Constructed with the :class:`engine.config.EngineConfig` and the number of blocks.
    Block 0 is the null block: never handed out, used to pad block tables."""

    def __init__(self, config: Any, num_blocks: int):
        self.config = config
        self.num_blocks = num_blocks

    @abstractmethod
    def get_computed_blocks(self, request) -> tuple[list[int], int]:
        """Cached blocks matching the request's leading tokens and how many tokens they hold.
        Never the whole sequence: the last token is always computed (it yields logits)."""

    @abstractmethod
    def allocate_slots(self, request, num_new_tokens: int, computed_blocks: list[int] = (),
                       num_lookahead_tokens: int = 0, watermark: bool = False) -> bool:
        """Own blocks for ``num_new_tokens`` more tokens (plus draft lookahead) after
        taking ``computed_blocks``. False, changing nothing, when blocks run out."""

    @abstractmethod
    def free(self, request) -> None:
        """Release the request's blocks; cached ones stay reusable until evicted."""

    @abstractmethod
    def block_ids(self, request) -> list[int]:
        """The request's block table."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes; False when blocks are still in use."""

    @property
    @abstractmethod
    def usage(self) -> float:
        """Fraction of blocks in use (0..1)."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        ...

    @property
    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters: ``prefix_queries`` and ``prefix_hits`` (tokens)."""
