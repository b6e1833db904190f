"""Planted bugs: the ngram drafter with one mistake each, the mistakes drafter authors make.
Verification is exact, so none changes greedy output (an id outside the vocabulary fails the
requests it reaches): the drafter kit catches them by the interface every proposal keeps,
and by seeded sampling's reproducibility. Not registered by the suite's conftest:
``tests/test_drafter_kit_mutations.py`` registers them in a child pytest that runs the drafter
kit on each, and checks that it fails."""

from __future__ import annotations

import random

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine import hookimpl
from engine.interfaces import Draft
from engine_spec_ngram.drafter import NgramDrafter, lookup


def _tokens(request) -> np.ndarray:
    return np.asarray(request.token_ids, dtype=np.int64)


class IgnoresRoom(NgramDrafter):
    """Drafts up to ``num_speculative_tokens`` every time, not the request's ``max_tokens`` (less
    near its max_tokens or max_model_len)."""

    def propose(self, requests):
        k = int(self.method_config["num_speculative_tokens"])
        return [Draft(lookup(_tokens(r), self.n_min, self.n_max, k)) for r in requests]


class DropsEmptyDrafts(NgramDrafter):
    """Returns drafts for the requests with a match only: the rest of the list shifts onto the
    wrong requests."""

    def propose(self, requests):
        return [draft for draft in super().propose(requests) if draft.token_ids]


class PadsWithMinusOne(NgramDrafter):
    """Pads each draft to the request's room with -1, a rectangular batch's filler, for the
    engine to drop."""

    def propose(self, requests):
        return [
            Draft(d.token_ids + [-1] * (r.max_tokens - len(d.token_ids)))
            for r, d in zip(requests, super().propose(requests))
        ]


class RandomOccurrence(NgramDrafter):
    """Continues a random earlier occurrence of the matched n-gram for a random number of tokens
    (unseeded), not the most recent one for all it may: the drafts, and with them seeded
    sampling's draws, differ from run to run (the length too, so that a prompt whose n-grams
    occur once still varies)."""

    def propose(self, requests):
        return [Draft(self._lookup(_tokens(r), r.max_tokens)) for r in requests]

    def _lookup(self, tokens, k):
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):
                start = random.choice(hits.tolist()) + n
                return tokens[start : start + random.randint(0, k)].tolist()
        return []


MUTANTS = {
    "ignores-room": IgnoresRoom,
    "drops-empty-drafts": DropsEmptyDrafts,
    "pads-with-minus-one": PadsWithMinusOne,
    "random-occurrence": RandomOccurrence,
}


@hookimpl
def register_drafters(register):
    for name, drafter in MUTANTS.items():
        register(name, drafter, api=1)
