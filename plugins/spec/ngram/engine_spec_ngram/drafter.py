"""Prompt lookup: find the longest suffix of the request's own tokens (between
``prompt_lookup_min`` and ``prompt_lookup_max`` tokens) that occurred before, and propose
the tokens that followed its most recent earlier occurrence."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.interfaces import Draft, Drafter


def lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        pattern = tokens[-n:]
        windows = sliding_window_view(tokens[:-1], n)  # every earlier n-gram (not the suffix itself)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return tokens[start : start + k].tolist()
    return []


class NgramDrafter(Drafter):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.n_max = int(self.method_config.get("prompt_lookup_max", 4))
        self.n_min = int(self.method_config.get("prompt_lookup_min", 1))
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")

    def propose(self, requests):
        return [
            Draft(lookup(np.asarray(r.token_ids, dtype=np.int64), self.n_min, self.n_max, r.max_tokens))
            for r in requests
        ]
