"""MTP drafting: the target checkpoint's multi-token-prediction module (DeepSeek-V3's) drafts.

The target's model plugin names the module (``Model.mtp_architecture``) and builds it from the
target's own checkpoint (``DrafterContext.load_model(None, architecture=...)``), loading only
its weights; the token embeddings are the target's. Like an EAGLE head, the module reads the
target's output hidden states of the positions just verified, the row of token t_{j} sitting at
position j - 1 beside the hidden state h_{j-1}; it writes its own KV cache (one latent layer per
MTP layer, indexed by the target's block tables) and chains k draft steps, each feeding back its
own output as the next hidden state (step d runs MTP layer d mod the layer count, as vLLM).
Positions whose hidden states it never saw (earlier prefill chunks) keep stale K/V: acceptance
drops, exactness does not.

Under tensor parallelism the module drafts on every rank (``drafts_on_every_rank``), as an
EAGLE head does: it embeds with the target's vocabulary-parallel embedding, a collective every
rank must join. The module itself is built whole on every rank (``load_model`` builds no
tensor-parallel group); rank 0's greedy choice is shared so every rank feeds the same tokens on."""

from __future__ import annotations

import torch

from engine.interfaces import Drafter
from engine.runner.drafting import Chunk, chain_drafts, run_chunks


class MTPDrafter(Drafter):
    needs_hidden_states = True
    drafts_on_every_rank = True

    def __init__(self, ctx):
        super().__init__(ctx)
        hf_config = ctx.target.ctx.hf_config
        architecture = type(ctx.target).mtp_architecture(hf_config)
        if architecture is None:
            names = ", ".join(getattr(hf_config, "architectures", None) or [type(ctx.target).__name__])
            layers = getattr(hf_config, "num_nextn_predict_layers", None)
            raise ValueError(
                f"speculative_config: method {self.method_config.get('method')!r} needs a checkpoint "
                f"with a multi-token-prediction module; {names} (num_nextn_predict_layers "
                f"{layers}) has none"
            )
        self.model = ctx.load_model(self.method_config.get("model"), architecture=architecture)
        self.attention = ctx.make_attention(self.model)
        self.kv_caches = [
            torch.zeros(self.attention.kv_cache_shape(ctx.num_blocks), dtype=ctx.dtype, device=ctx.device)
            for _ in range(self.model.kv_layout().num_layers)
        ]
        self.block_size = ctx.config.cache.block_size

    def propose(self, requests):
        return chain_drafts(requests, self._step)

    @torch.inference_mode()
    def _step(self, chunks: list[Chunk], hidden_states: list[torch.Tensor], depth: int):
        """One MTP pass over the chunks -> (its hidden states, each chunk's last row, each
        chunk's greedy token from MTP layer ``depth``)."""
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.ctx.device)
        out, rows = run_chunks(
            self.model,
            self.attention,
            self.kv_caches,
            chunks,
            self.block_size,
            self.ctx.device,
            previous_hidden_states=torch.cat(hidden_states),
            inputs_embeds=self.ctx.target.embed(ids),
            depth=depth,
        )
        tokens = self.model.compute_logits(out[rows], depth=depth).argmax(dim=-1).tolist()
        return out, rows, self.ctx.share(tokens)
