"""Test plugin for the speculation seam: drafts from a known continuation, deliberately
wrong every ``corrupt_every``-th draft, so accepted, rejected and bonus tokens all occur."""

from __future__ import annotations

from engine import hookimpl
from engine.interfaces import Draft, Drafter


@hookimpl
def register_drafters(register):
    register("test-oracle", OracleDrafter, api=1)


class OracleDrafter(Drafter):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.continuations = [list(c) for c in self.method_config["continuations"]]
        self.corrupt_every = self.method_config.get("corrupt_every", 3)
        self.calls = 0

    def propose(self, requests):
        out = []
        for r in requests:
            tokens = list(r.token_ids)
            draft = []
            for full in self.continuations:
                if full[: len(tokens)] == tokens:
                    draft = full[len(tokens) : len(tokens) + r.max_tokens]
                    break
            self.calls += 1
            if draft and self.calls % self.corrupt_every == 0:
                draft[len(draft) // 2] = (draft[len(draft) // 2] + 1) % 256
            out.append(Draft(draft))
        return out
