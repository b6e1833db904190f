"""KVConnector: moves KV cache blocks to and from outside the engine (host tier, another
instance). The scheduler half decides how many tokens come from outside and when blocks
may be freed; the worker half moves the data around each step."""

from abc import ABC, abstractmethod
from typing import Any

import torch


class KVConnector(ABC):
    def __init__(self, ctx: Any):
        """``ctx`` is the :class:`engine.config.EngineConfig`."""
        self.ctx = ctx

    # -- scheduler half ---------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (a block multiple) that can be loaded
        from outside instead of computed."""

    @abstractmethod
    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request got ``block_ids``; its ``num_external_tokens`` after the locally
        cached ones are to be loaded this step."""

    def request_finished(self, request, block_ids: list[int]) -> bool:
        """Called when a request finishes; True delays freeing its blocks until
        :meth:`get_finished` reports it sent."""
        return False

    # -- worker half ------------------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_dim: int) -> None:
        """One cache tensor per layer, in the attention backend's layout; ``block_dim`` is
        the dimension that indexes blocks (``index_select(block_dim, ids)`` takes blocks)."""

    @abstractmethod
    def start_load_kv(self) -> None:
        """Before the forward: start loading what ``update_state_after_alloc`` asked for."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until ``layer``'s KV is loaded (layer-wise pipelining)."""

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor) -> None:
        """After ``layer`` wrote this step's KV."""

    def wait_for_save(self) -> None:
        """After the forward: all saves issued this step are done."""

    def get_finished(self) -> set[str]:
        """Request ids whose delayed blocks may now be freed."""
        return set()
