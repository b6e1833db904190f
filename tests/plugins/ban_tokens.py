"""Test plugin for the logits-processor seam: bans the token ids a request lists in
``extra_args["ban"]``."""

from __future__ import annotations

from engine import hookimpl
from engine.interfaces import LogitsProcessor


@hookimpl
def register_logits_processors(register):
    register("test-ban", BanTokens, api=1)


class BanTokens(LogitsProcessor):
    def apply(self, logits, requests):
        for row, request in enumerate(requests):
            banned = (request.sampling_params.extra_args or {}).get("ban")
            if banned:
                logits[row, banned] = float("-inf")
        return logits
