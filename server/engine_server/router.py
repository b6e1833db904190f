"""Which data-parallel replica serves a request.

``prefix`` (the default) sends a prompt to the replica most likely to hold its longest
prefix in its KV cache, so a shared system prompt or few-shot header is computed once per
replica that serves it rather than once on every replica. The router remembers which prompt
blocks it sent where, in the engine's own chained block hashes (the cache salt included),
each replica's record bounded by that replica's KV blocks and forgotten oldest-first, as the
engine evicts. With ``--kv-events-config`` the cores' KV events correct the record as they
arrive: a block a core evicted is forgotten at once, one it stored is known. A load guard
overrides affinity: when the preferred replica has ``BALANCE_ABS`` more open requests than
the least loaded one and ``BALANCE_REL`` times as many, the least loaded one gets the
request (and from then on holds that prefix too). A prompt no replica holds goes to the least
loaded one, and among those to the one holding the fewest blocks. ``round-robin`` ignores
prefixes.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from engine.client.kv_events import BlockRemoved, BlockStored
from engine.messages.kv_events import chain_hashes, external_hash
from engine.messages.multimodal import MultiModalItem, block_extra_keys

ROUTING = ("prefix", "round-robin")
BALANCE_ABS = 8  # open requests more than the least loaded replica ...
BALANCE_REL = 1.5  # ... and this many times as many: affinity gives way to load


def block_hashes(
    prompt: Sequence[int], block_size: int, salt: str | None = None, mm_items: Sequence[MultiModalItem] = ()
) -> list[int]:
    """The prompt's full blocks as the engine's KV events name them: a block an image overlaps
    is keyed by the image's hash too, so the same text over another image is another prefix."""
    starts = range(0, len(prompt) - block_size + 1, block_size)
    extras = [block_extra_keys(mm_items, s, s + block_size) for s in starts] if mm_items else ()
    return [external_hash(h) for h in chain_hashes(prompt, block_size, salt, block_extras=extras)]


class PrefixRecord:
    """The blocks one replica was sent, most recent last, at most ``capacity``."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def matched(self, hashes: list[int]) -> int:
        """How many of ``hashes``, from the first, this replica holds."""
        return next((i for i, h in enumerate(hashes) if h not in self._blocks), len(hashes))

    def add(self, hashes: list[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def remove(self, hashes: list[int]) -> None:
        for h in hashes:
            self._blocks.pop(h, None)

    def clear(self) -> None:
        self._blocks.clear()


class Router:
    def __init__(self, policy: str, num_replicas: int, block_size: int, capacity_blocks: int):
        if policy not in ROUTING:
            raise ValueError(f"data_parallel_routing must be one of {', '.join(ROUTING)}, got {policy!r}")
        self.policy, self.block_size = policy, block_size
        self.records = [PrefixRecord(capacity_blocks) for _ in range(num_replicas)]
        self._turns = itertools.cycle(range(num_replicas))

    def choose(
        self,
        prompt: Sequence[int],
        loads: Sequence[int],
        salt: str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
    ) -> int:
        """The replica for a prompt (and its images), given each replica's open requests."""
        if self.policy == "round-robin":
            return next(self._turns)
        hashes = block_hashes(prompt, self.block_size, salt, mm_items)
        least = min(range(len(loads)), key=loads.__getitem__)
        matches = [record.matched(hashes) for record in self.records]
        # the longest match; among equal matches the least loaded replica, then the one holding
        # the fewest blocks (a new prefix goes where it evicts least)
        best = max(range(len(loads)), key=lambda r: (matches[r], -loads[r], -len(self.records[r])))
        if loads[best] - loads[least] > BALANCE_ABS and loads[best] > BALANCE_REL * loads[least]:
            best = least
        self.records[best].add(hashes)
        return best

    def observe(self, replica: int, batch) -> None:
        """A core's KV event batch (``engine.client.kv_events.KVEventBatch``)."""
        record = self.records[replica]
        for event in batch.events:
            if isinstance(event, BlockStored):
                record.add(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                record.remove(event.block_hashes)
            else:
                record.clear()
