"""VocabEmbedding: the input embedding table and the LM head, both a [vocab, hidden] weight.

It is a :class:`Linear` (so checkpoint loading and quant methods treat it like one) whose
``forward`` looks rows up and whose ``logits`` multiplies by the table. A tied model uses one
instance for both. It goes through the selected quant method only when that method sets
``quantizes_embeddings`` (GGUF files quantize these tables); otherwise it stays unquantized.

Built for a tensor-parallel group it is vocabulary-parallel: rank r holds rows
[r·⌈V/N⌉, (r+1)·⌈V/N⌉) (the last rank's tail padded with zero rows). A lookup outside its rows
gives zeros and the ranks' lookups are all-reduced; the logits of each rank's rows are
gathered on rank 0 (the only rank that samples; the others get None).

Its model says what each table serves (``serves_lookups``, ``serves_logits``): a table that
computes logits may be prepacked for the platform's matmul, one that serves only logits (an
untied LM head) then keeps no plain copy for lookups.
"""

from __future__ import annotations

import torch

from engine.distributed import current_tensor_parallel
from engine.layers.checkpoint import materialize
from engine.layers.linear import Linear
from engine.layers.unquantized import UnquantizedLinearMethod
from engine.native.rows import first_max


class VocabEmbedding(Linear):
    def __init__(self, vocab_size: int, hidden_size: int, method, dtype: torch.dtype):
        if not method.quantizes_embeddings:
            method = UnquantizedLinearMethod(method.ctx)
        tp = current_tensor_parallel()
        per_rank = -(-vocab_size // tp.size)
        super().__init__(hidden_size, [per_rank], False, method, dtype)
        self.tp, self.vocab_size = tp, vocab_size
        self.vocab_start = tp.rank * per_rank
        self.vocab_rows = max(0, min(vocab_size, self.vocab_start + per_rank) - self.vocab_start)
        self.serves_lookups, self.serves_logits = True, False
        if tp.size > 1:
            self.weight.data.zero_()  # the padding rows

    def rank_part(self, param: torch.Tensor, tensor, shard: int) -> torch.Tensor:
        if self.tp.size == 1:
            return materialize(tensor)
        return tensor.narrow(0, self.vocab_start, self.vocab_rows)

    def load_shard(self, param_name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        """A quant method's ``weight_loader`` receives this rank's ``vocab_rows`` rows (the last
        rank's may be fewer than the layer's: the method pads them with zero rows)."""
        param = getattr(self, param_name)
        if self.tp.size == 1 or hasattr(param, "weight_loader"):
            super().load_shard(param_name, tensor, shard)
            return
        param.data[: self.vocab_rows].copy_(self.rank_part(param, tensor, shard))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.method.embed(self, input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        rows = self.method.embed(self, local.masked_fill(outside, 0))
        return self.tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's first maximum of ``logits(hidden)`` (int64 [N]): the quant method's own
        where it finds it without the logits (``QuantMethod.apply_greedy``; under
        ``--batch-invariant`` only a method that declares ``greedy_batch_invariant``), else the
        argmax of the logits as the table's matmul gives them, in its dtype (a float32 copy
        orders them the same: it would be torch work between the kernels, which a native tape
        cannot record). None under tensor parallelism or LoRA on this table: the caller then
        takes the argmax of the gathered logits."""
        if self.tp.size > 1 or "lora" in self._modules:
            return None
        if not getattr(self.method.ctx, "batch_invariant", False) or self.method.greedy_batch_invariant:
            tokens = self.method.apply_greedy(self, hidden)
            if tokens is not None:
                return tokens
        return first_max(self.matmul(hidden, None))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.matmul(hidden, None)
        if self.tp.size == 1:
            return logits
        gathered = self.tp.gather(logits)
        return None if gathered is None else gathered[:, : self.vocab_size]
