"""DeepSeek-V3's multi-token-prediction (MTP) module, for an MTP drafter (``DeepSeekMTPModel``).

A V3 checkpoint stores it as decoder layers past the last (``model.layers.<N>``, N =
``num_hidden_layers``, ``num_nextn_predict_layers`` of them): ``enorm``, ``hnorm``, ``eh_proj``,
one full DeepSeek decoder layer (MLA attention, MoE), ``shared_head.norm`` and
``shared_head.head``. For the row of token t_{i+1} at position i, given the hidden state h_i
of the position before::

    h' = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])   # embedding first, as the weights take it
    out = h' + block(h')                                 # the block's residual stream
    logits = shared_head.head(shared_head.norm(out))     # a guess at t_{i+2}

(the paper writes the concatenation hidden first; the released weights, vLLM and SGLang put
the embedding first). As in vLLM, the embedding of the row at position 0 is zeroed. ``out``
feeds the next draft step as its h. The token embeddings are the target's, handed in
(``inputs_embeds``): the copy V3 checkpoints keep under the MTP layer is not loaded. A checkpoint
without ``shared_head.head`` gets the main LM head. The module's KV cache holds one latent
layer per MTP layer (its own, indexed by the target's block tables).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.distributed import current_tensor_parallel
from engine.interfaces import KVLayout, Model
from engine.layers import LayerOps, RMSNorm, RotaryEmbedding, VocabEmbedding, load_checkpoint
from engine_models_deepseek.model import (
    MLP_PROJECTIONS,
    MTP_ARCHITECTURE,
    deepseek_layer,
    latent_kv_layout,
    up_projection_rows,
)

# an MTP layer's own modules; everything else under model.layers.<N> is its decoder block's
OWN_MODULES = ("enorm", "hnorm", "eh_proj", "shared_head")
LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)")


class SharedHead(nn.Module):
    def __init__(self, cfg, method, dtype, ops: LayerOps):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.head = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, method, dtype)
        self.head.serves_lookups, self.head.serves_logits = False, True


class MTPLayer(nn.Module):
    def __init__(self, cfg, depth: int, method, dtype, ops: LayerOps):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype)  # unquantized in V3's fp8 release
        self.mtp_block = deepseek_layer(cfg, cfg.num_hidden_layers + depth, depth, method, dtype, ops)
        self.shared_head = SharedHead(cfg, method, dtype, ops)


class DeepseekMTP(Model):
    architectures = (MTP_ARCHITECTURE,)
    drafter_only = True

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = self.cfg = ctx.hf_config
        self.tensor_parallel = current_tensor_parallel()  # the group its layers are built for
        ops = ctx.layer_ops or LayerOps()
        count = getattr(cfg, "num_nextn_predict_layers", 0)
        if not count:
            raise ValueError(f"{MTP_ARCHITECTURE}: the config has no num_nextn_predict_layers")
        self.rotary = RotaryEmbedding(cfg, cfg.max_position_embeddings, ctx.dtype, ops)
        self.layers = nn.ModuleList(MTPLayer(cfg, d, ctx.linear_method, ctx.dtype, ops) for d in range(count))
        self.tied = getattr(cfg, "tie_word_embeddings", False)

    def kv_layout(self) -> KVLayout:
        return latent_kv_layout(self.cfg, len(self.layers), self.tensor_parallel)

    def forward(self, input_ids, positions, step, previous_hidden_states=None, inputs_embeds=None, depth=0):
        layer = self.layers[depth % len(self.layers)]
        embeds = inputs_embeds.masked_fill((positions == 0)[:, None], 0.0)
        hidden = layer.eh_proj(
            torch.cat([layer.enorm(embeds), layer.hnorm(previous_hidden_states.to(embeds.dtype))], dim=-1)
        )
        out, residual = layer.mtp_block(self.rotary(positions), hidden, None, step)
        return out + residual

    def compute_logits(self, hidden, depth=0):
        head = self.layers[depth % len(self.layers)].shared_head
        logits = head.head.logits(head.norm(hidden))
        return None if logits is None else logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = up_projection_rows(self._own_weights(weights), self.cfg, self.tensor_parallel)
        load_checkpoint(self, own, fused=MLP_PROJECTIONS)

    def _own_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The MTP layers' tensors under this module's names, then the main LM head for every
        layer whose checkpoint has no ``shared_head.head``."""
        first, count = self.cfg.num_hidden_layers, len(self.layers)
        main_head_name = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        main_head, seen_layers, heads = None, set(), set()
        for name, tensor in weights:
            if name == main_head_name:
                main_head = tensor
            match = LAYER_TENSOR.fullmatch(name)
            if not match or not first <= int(match[1]) < first + count:
                continue
            depth, rest = int(match[1]) - first, match[2]
            seen_layers.add(depth)
            if rest.startswith("embed_tokens.") or "rotary_emb" in rest:
                continue  # the target's embeddings are used
            if rest.startswith("shared_head.head."):
                heads.add(depth)
            module = "" if rest.split(".")[0] in OWN_MODULES else "mtp_block."
            yield f"layers.{depth}.{module}{rest}", tensor
        if len(seen_layers) < count:
            raise ValueError(
                f"{MTP_ARCHITECTURE}: the checkpoint has no multi-token-prediction weights "
                f"(model.layers.{first}.* ...) though num_nextn_predict_layers is {count}"
            )
        for depth in sorted(set(range(count)) - heads):
            if main_head is not None:
                yield f"layers.{depth}.shared_head.head.weight", main_head
