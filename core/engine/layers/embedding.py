"""VocabEmbedding: the input embedding table and the LM head, both a [vocab, hidden] weight.

It is a :class:`Linear` (so checkpoint loading and quant methods treat it like one) whose
``forward`` looks rows up and whose ``logits`` multiplies by the table. A tied model uses one
instance for both. It goes through the selected quant method only when that method sets
``quantizes_embeddings`` (GGUF files quantize these tables); otherwise it stays unquantized.
"""

from __future__ import annotations

import torch

from engine.builtin.unquantized import UnquantizedLinearMethod
from engine.layers.linear import Linear


class VocabEmbedding(Linear):
    def __init__(self, vocab_size: int, hidden_size: int, method, dtype: torch.dtype):
        if not method.quantizes_embeddings:
            method = UnquantizedLinearMethod(method.ctx)
        super().__init__(hidden_size, [vocab_size], False, method, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.method.embed(self, input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.matmul(hidden, None)
