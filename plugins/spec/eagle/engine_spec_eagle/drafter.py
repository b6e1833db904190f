"""EAGLE drafting (EAGLE-1 and EAGLE-3 heads): the head reads the target's hidden states of
the positions just verified (for EAGLE-3, the residual streams after three target layers;
feature at position t with the token at t + 1), writes its own one-layer KV cache
(indexed by the target's block tables), and chains k draft steps, each feeding back its
own output as the next feature. Positions whose features it never saw (earlier prefill
chunks) keep stale head K/V: acceptance drops, exactness does not.

Under tensor parallelism the head drafts on every rank (``drafts_on_every_rank``): it embeds
with the target's vocabulary-parallel embedding (and EAGLE-1 scores with its LM head), each a
collective. The head itself is whole on every rank; rank 0 chooses each draft token
(EAGLE-1's logits exist only there) and shares it, so every rank feeds the same tokens on."""

from __future__ import annotations

import torch
from transformers import AutoConfig

from engine.interfaces import Drafter
from engine.runner.drafting import Chunk, chain_drafts, run_chunks
from engine_spec_eagle.head import Eagle3Head, build_head, checkpoint_tensors


class EagleDrafter(Drafter):
    needs_hidden_states = True
    drafts_on_every_rank = True

    def __init__(self, ctx):
        super().__init__(ctx)
        path = self.method_config.get("model")
        if not path:
            raise ValueError('speculative_config for eagle needs "model": the EAGLE head checkpoint folder')
        config = AutoConfig.from_pretrained(path)
        tensors = checkpoint_tensors(path)
        with torch.device(ctx.device):
            self.head = build_head(config, tensors, ctx.target, ctx.target.ctx.linear_method, ctx.dtype)
        self.aux_layers = self._aux_layers(config, ctx.target) if isinstance(self.head, Eagle3Head) else None
        for module in self.head.modules():
            if hasattr(module, "process_weights_after_loading") and module is not self.head:
                module.process_weights_after_loading()
        self.head.eval()
        self.attention = ctx.make_attention(self.head)
        self.kv_caches = [
            torch.zeros(self.attention.kv_cache_shape(ctx.num_blocks), dtype=ctx.dtype, device=ctx.device)
        ]
        self.block_size = ctx.config.cache.block_size

    @staticmethod
    def _aux_layers(config, target) -> tuple[int, ...]:
        """EAGLE-3 reads the residual streams after these target layers (the checkpoint's
        ``eagle_aux_hidden_state_layer_ids``, else low, middle and high as published)."""
        ids = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            layers = target.kv_layout().num_layers
            ids = (2, layers // 2, layers - 3)
        return tuple(sorted(set(ids)))

    def hidden_state_layers(self):
        return self.aux_layers

    def propose(self, requests):
        return chain_drafts(requests, self._step)

    def _step(self, chunks: list[Chunk], features: list[torch.Tensor], step: int):
        """One pass of the head over the chunks -> (its hidden states, each chunk's last row,
        each chunk's greedy token)."""
        hidden, rows = run_chunks(
            self.head,
            self.attention,
            self.kv_caches,
            chunks,
            self.block_size,
            self.ctx.device,
            features=torch.cat(features),
        )
        logits = self.head.compute_logits(hidden[rows])  # None on a tensor-parallel rank but 0
        return hidden, rows, self.ctx.share(None if logits is None else logits.argmax(dim=-1).tolist())
