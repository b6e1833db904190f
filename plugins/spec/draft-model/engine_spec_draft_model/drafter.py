"""Draft with a model: either a separate, smaller model with the same tokenizer
(``"model": PATH``), which keeps its own KV cache indexed by the target's block tables,
or the target's own first N layers and LM head (``"self_draft_layers": N``, layer-skip),
which shares the target's KV cache: those layers' K/V for verified positions are exactly
the target's, and what the draft writes for its own tokens the target's verification
overwrites with the same values.

Each round runs, batched over requests, one catch-up chunk (the tokens the draft cache
has not seen yet) and then one token per further draft. Greedy requests draft greedily;
sampling requests draw from the draft's own distribution at their temperature and hand it
to the core, whose rejection sampler makes the result exact.
"""

from __future__ import annotations

import torch

from engine.interfaces import Draft, Drafter
from engine.runner.drafting import Chunk, run_chunks


class DraftModelDrafter(Drafter):
    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = self.method_config
        self.block_size = ctx.config.cache.block_size
        if cfg.get("self_draft_layers"):
            self.model = ctx.target.draft_view(int(cfg["self_draft_layers"]))
            if self.model is None:
                raise ValueError(f"speculative_config: {type(ctx.target).__name__} cannot self-draft")
            self.attention, self.kv_caches, self.shared = ctx.attention, ctx.kv_caches, True
        elif cfg.get("model"):
            self.model = ctx.load_model(cfg["model"])
            self.attention = ctx.make_attention(self.model)
            self.kv_caches = [
                torch.zeros(self.attention.kv_cache_shape(ctx.num_blocks), dtype=ctx.dtype, device=ctx.device)
                for _ in range(self.model.kv_layout().num_layers)
            ]
            self.shared = False
        else:
            raise ValueError('speculative_config for draft_model needs "model" or "self_draft_layers"')
        self._cached: dict[str, list[int]] = {}  # tokens whose K/V the draft cache holds, per request
        self._generators: dict[str, torch.Generator] = {}

    def propose(self, requests):
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        chunks = [self._catch_up(r) for r in requests]
        live = list(range(len(requests)))
        for step in range(max(r.max_tokens for r in requests)):
            hidden, rows = run_chunks(
                self.model,
                self.attention,
                self.kv_caches,
                [chunks[i] for i in live],
                self.block_size,
                self.ctx.device,
            )
            logits = self.model.compute_logits(hidden[rows])
            next_live = []
            for row, i in enumerate(live):
                token, dist = self._choose(requests[i], logits[row])
                drafts[i].append(token)
                if dist is not None:
                    probs[i].append(dist)
                if step + 1 < requests[i].max_tokens:
                    position = len(requests[i].token_ids) + step
                    chunks[i] = Chunk([token], position, requests[i].block_ids)
                    next_live.append(i)
            live = next_live
            if not live:
                break
        for request, tokens in zip(requests, drafts):
            self._cached[request.request_id] = list(request.token_ids) + tokens[:-1]
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(drafts, probs)]

    def _catch_up(self, request) -> Chunk:
        tokens = list(request.token_ids)
        known = 0 if self.shared else _common_prefix(self._cached.get(request.request_id, []), tokens)
        start = len(tokens) - 1 if self.shared else min(known, len(tokens) - 1)
        return Chunk(tokens[start:], start, request.block_ids)

    def _choose(self, request, logits: torch.Tensor):
        params = request.sampling_params
        if params is None or params.greedy:
            return int(logits.argmax()), None
        dist = (logits.float() / params.temperature).softmax(dim=-1)
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator().manual_seed(
                params.seed if params.seed is not None else int(torch.randint(2**31, ()))
            )
            self._generators[request.request_id] = generator
        return int(torch.multinomial(dist.cpu(), 1, generator=generator)), dist

    def finished(self, request_ids) -> None:
        for rid in request_ids:
            self._cached.pop(rid, None)
            self._generators.pop(rid, None)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
