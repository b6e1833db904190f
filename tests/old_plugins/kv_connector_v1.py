"""A KV connector as written against interface v1 (release 1), frozen: the one object that was
both halves (``register_kv_caches``, ``start_load_kv``, no block hashes, no asynchronous or failed
loads, layer hooks outside the forward), constructed with the engine config. Interface v2 split
it into two halves joined by picklable per-step metadata; a v1 connector cannot be driven by
today's engine and is refused when it registers ("Interface versions" in the plugin authors'
guide says how to port one)."""

from __future__ import annotations

import torch

from engine import hookimpl
from engine.interfaces import KVConnector

STORE: dict[tuple[int, ...], list] = {}  # token prefix -> per-layer copies of its blocks


@hookimpl
def register_kv_connectors(register):
    register("memory-v1", MemoryConnector, api=1)


class MemoryConnector(KVConnector):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.block_size = ctx.cache.block_size
        self.caches = []
        self.block_dim = 1
        self.pending = []  # (saved key, first block index, destination block ids)

    def _best(self, tokens, num_computed):
        keys = [
            k
            for k in STORE
            if len(k) > num_computed and len(k) < len(tokens) and tuple(tokens[: len(k)]) == k
        ]
        return max(keys, key=len, default=None)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        key = self._best(request.all_token_ids, num_computed_tokens)
        return 0 if key is None else len(key) - num_computed_tokens

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        key = self._best(request.all_token_ids, request.num_computed_tokens)
        first = request.num_computed_tokens // self.block_size
        last = (request.num_computed_tokens + num_external_tokens) // self.block_size
        self.pending.append((key, first, block_ids[first:last]))

    def request_finished(self, request, block_ids):
        full = request.num_prompt_tokens // self.block_size
        if full and self.caches:
            key = tuple(request.prompt_token_ids[: full * self.block_size])
            ids = torch.tensor(block_ids[:full])
            STORE[key] = [cache.index_select(self.block_dim, ids) for cache in self.caches]
        return False

    def register_kv_caches(self, kv_caches, block_dim):
        self.caches, self.block_dim = kv_caches, block_dim

    def start_load_kv(self):
        for key, first, blocks in self.pending:
            saved = torch.arange(first, first + len(blocks))
            for layer, cache in enumerate(self.caches):
                cache.index_copy_(
                    self.block_dim,
                    torch.tensor(blocks),
                    STORE[key][layer].index_select(self.block_dim, saved),
                )
        self.pending.clear()
