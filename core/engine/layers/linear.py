"""Linear: one matmul whose weight may be several fused projections (q|k|v, gate|up)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.checkpoint import materialize
from engine.layers.module import Layer


class Linear(Layer):
    # What the weight serves, for a quant method that repacks it: a projection's matmul runs
    # (``serves_logits``) and its rows are never looked up; a vocabulary table says which it does.
    serves_logits = True
    serves_lookups = False

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, method, dtype: torch.dtype):
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        # the checkpoint's sizes, of which a tensor-parallel layer holds a part
        self.full_input_size, self.full_output_sizes = input_size, list(output_sizes)
        self.method = method
        method.create_weights(self, input_size, self.output_sizes)
        self.bias = (
            nn.Parameter(torch.zeros(sum(output_sizes), dtype=dtype), requires_grad=False) if bias else None
        )
        if self.bias is not None:
            self.bias.output_dim = 0

    def load_shard(self, param_name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        """Copy one projection's checkpoint tensor into its slice of the fused parameter
        (a tensor-parallel layer first takes this rank's part: :meth:`rank_part`)."""
        param = getattr(self, param_name)
        tensor = self.rank_part(param, tensor, shard)
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor, shard)
            return
        dim = getattr(param, "output_dim", None)
        if dim is None or len(self.output_sizes) == 1:
            param.data.copy_(tensor)
            return
        per_row = param.shape[dim] // sum(self.output_sizes)
        start = sum(self.output_sizes[:shard]) * per_row
        param.data.narrow(dim, start, self.output_sizes[shard] * per_row).copy_(tensor)

    def rank_part(self, param: torch.Tensor, tensor, shard: int) -> torch.Tensor:
        """The part of checkpoint tensor ``tensor`` (a torch tensor, or a lazy
        :class:`engine.layers.loading.CheckpointSlice`) this rank holds: all of it here."""
        return materialize(tensor)

    def lora_part(self, shard: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The part of a LoRA adapter's A [r, in] and B [out, r] for fused projection ``shard``
        that this rank adds: all of it here (a tensor-parallel layer cuts it as its weight)."""
        return a, b

    def full_row_max(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row ``values`` (e.g. each row's largest magnitude) a quant method computed on the
        weight this rank holds, made whole-row: as they are here, where every row is whole; a
        row-parallel layer maxes them over its group (call it on every rank, in
        ``process_weights_after_loading``)."""
        return values

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x · wᵀ (+ bias), plus the step's LoRA deltas where adapters may run on this layer (a
        submodule ``lora``, :class:`engine.layers.lora.LoRASlots`; a tensor-parallel layer adds
        them before its all-reduce)."""
        if getattr(self.method.ctx, "batch_invariant", False):
            out = self.method.apply_batch_invariant(self, x, bias)
        else:
            out = self.method.apply(self, x, bias)
        lora = self._modules.get("lora")  # not getattr: a miss would raise and catch per call
        return out if lora is None else lora.add(out, x)
