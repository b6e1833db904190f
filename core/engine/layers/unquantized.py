"""The default linear method: a plain weight in the activation dtype (registered by the core's
built-ins as ``unquantized``; the layers fall back to it for what a method does not quantize)."""

import torch
import torch.nn.functional as F
from torch import nn

from engine.interfaces import QuantMethod
from engine.layers.batch_invariant import in_row_buckets
from engine.layers.experts import grouped_matmul


class UnquantizedLinearMethod(QuantMethod):
    name = "unquantized"
    quantizes_experts = True
    shards_for_tensor_parallel = True
    splits_experts = True

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_sizes), input_size, dtype=self.ctx.dtype), requires_grad=False
        )
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Hand a projection's weight to the platform's prepacked matmul where it has one
        (``LayerOps.pack_dense``). A vocabulary table is packed only when it computes logits
        (1.7× faster at 64 rows on the CPU), and keeps its plain rows too when it also serves
        lookups (a tied table: held twice). Batch-invariant engines pack too: their row
        buckets are probed on the kernel that runs (oneDNN's packed GEMM passed at every bucket
        up to 1024 rows on an AMD EPYC without AMX, and beat ``F.linear`` on all but the down
        projection: docs/decisions.md, "Batch-invariant mode")."""
        if not layer.serves_logits:
            return
        packed = self.ctx.platform.layer_ops(self.ctx.dtype).pack_dense(layer.weight.data)
        if packed is not None:
            if not layer.serves_lookups:
                del layer.weight
            layer.dense = packed

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        dense = layer._modules.get("dense")  # not getattr: a miss would raise and catch per call
        return F.linear(x, layer.weight, bias) if dense is None else dense(x, bias)

    def kernel_of(self, layer: nn.Module) -> nn.Module | None:
        return layer._modules.get("dense")

    def apply_batch_invariant(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """A prepacked kernel that declares ``invariant_rows`` (cpu-native's widening and AMX
        kernels) unpadded; else one call padded to a row count at which this weight's GEMM was
        probed to give each row the bits 16-row tiles give it (both
        :func:`~engine.layers.batch_invariant.in_row_buckets`): the probes are shared by the
        layers of one kernel and weight shape."""
        dense = self.kernel_of(layer)  # its type names the probes: NoneType for F.linear
        key = (
            type(dense).__name__,
            layer.input_size,
            sum(layer.output_sizes),
            self.ctx.dtype,
            bias is not None,
        )
        return in_row_buckets(lambda rows: self.apply(layer, rows, bias), x, key, dense)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        dense = layer._modules.get("dense")
        return layer.weight if dense is None else dense.dequantize()

    def embed(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """The table's rows by the platform's ``gather_rows`` (a C kernel on cpu-native, which a
        native tape records: with bfloat16 matmuls on its kernel too, an unquantized decode step
        is tape-recordable)."""
        if input_ids.dim() != 1:
            return F.embedding(input_ids, layer.weight)
        return self.ctx.platform.layer_ops(self.ctx.dtype).gather_rows(layer.weight, input_ids)

    def apply_moe(self, layer: nn.Module, x: torch.Tensor, segments) -> torch.Tensor:
        return grouped_matmul(x, layer.weight, segments)

    def dequantize_moe(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight
