"""FusedMoE's grouped path against a per-expert loop in plain math, the expert-parallel seam and
loading experts from checkpoint names."""

from __future__ import annotations

import pytest
import torch

from engine.distributed import TensorParallel, tensor_parallel
from engine.interfaces import QuantContext
from engine.layers import FusedMoE, LayerOps, load_checkpoint
from engine.layers.experts import ExpertSegments, grouped_matmul
from engine.layers.moe import expert_split_note
from engine.layers.unquantized import UnquantizedLinearMethod
from engine.testing.moe import loaded_moe, reference_moe

EXPERTS, HIDDEN, INTERMEDIATE = 8, 48, 40  # sizes that are no block multiple


def unquantized(dtype, batch_invariant: bool = False):
    return UnquantizedLinearMethod(QuantContext(None, dtype, None, batch_invariant))


def inputs(tokens: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(tokens, HIDDEN, generator=gen).to(dtype),
        torch.randn(tokens, EXPERTS, generator=gen).to(dtype) * 2,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_grouped_path_matches_per_expert_reference(tokens, top_k, renormalize, dtype):
    layer, _, (gate_up, down) = loaded_moe(
        unquantized(dtype), EXPERTS, top_k, HIDDEN, INTERMEDIATE, renormalize
    )
    x, logits = inputs(tokens, dtype, seed=tokens)
    got = layer(x, logits)
    assert got.shape == x.shape and got.dtype == dtype
    want = reference_moe(x, logits, gate_up, down, top_k, renormalize)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    if dtype == torch.float32:  # the layer's stored experts are the checkpoint's
        torch.testing.assert_close(layer.gate_up.method.dequantize_moe(layer.gate_up), gate_up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "sizes", [(33, 21), (48, 40)]
)  # the loop's operands; torch._grouped_mm's (16-byte rows)
def test_grouped_matmul_equals_the_loop_over_experts(dtype, sizes):
    """The one-call path and the loop over experts with rows (the fallback off the CPU and
    for unaligned rows), empty experts included."""
    gen = torch.Generator().manual_seed(1)
    inner, outer = sizes
    counts = torch.tensor([3, 0, 5, 0, 0, 1, 9, 0])
    x = torch.randn(int(counts.sum()), inner, generator=gen).to(dtype)
    weight = torch.randn(8, outer, inner, generator=gen).to(dtype)
    segments = ExpertSegments.from_counts(counts)
    loop = segments.per_expert(x, outer, lambda e, rows: rows @ weight[e].t())
    torch.testing.assert_close(grouped_matmul(x, weight, segments), loop, atol=1e-5, rtol=1e-5)
    empty = ExpertSegments.from_counts(torch.zeros(8, dtype=torch.long))
    assert grouped_matmul(x[:0], weight, empty).shape == (0, outer)


def test_routing_renormalizes_only_when_asked():
    x, logits = inputs(5, torch.float32)
    for renormalize in (True, False):
        layer, _, (gate_up, down) = loaded_moe(
            unquantized(torch.float32), EXPERTS, 2, HIDDEN, INTERMEDIATE, renormalize
        )
        torch.testing.assert_close(
            layer(x, logits), reference_moe(x, logits, gate_up, down, 2, renormalize), atol=2e-5, rtol=1e-5
        )
    renormed = loaded_moe(unquantized(torch.float32), EXPERTS, 2, HIDDEN, INTERMEDIATE, True)[0](x, logits)
    plain = loaded_moe(unquantized(torch.float32), EXPERTS, 2, HIDDEN, INTERMEDIATE, False)[0](x, logits)
    assert not torch.allclose(renormed, plain)


def test_expert_parallel_ranks_sum_to_the_whole_layer():
    """Two ranks holding half the experts each: their outputs (the other rank's pairs dropped)
    add up to the single-rank layer's, and each stores only its own experts."""
    x, logits = inputs(16, torch.float32, seed=2)
    whole = loaded_moe(unquantized(torch.float32), EXPERTS, 2, HIDDEN, INTERMEDIATE, True)[0]
    ranks = [
        loaded_moe(unquantized(torch.float32), EXPERTS, 2, HIDDEN, INTERMEDIATE, True, local_experts=experts)[
            0
        ]
        for experts in ([0, 2, 4, 6], [1, 3, 5, 7])
    ]
    assert ranks[0].gate_up.weight.shape == (4, 2 * INTERMEDIATE, HIDDEN)
    torch.testing.assert_close(
        ranks[0](x, logits) + ranks[1](x, logits), whole(x, logits), atol=2e-5, rtol=1e-5
    )
    with pytest.raises(ValueError, match="local_experts"):
        FusedMoE(
            EXPERTS,
            2,
            HIDDEN,
            INTERMEDIATE,
            True,
            unquantized(torch.float32),
            torch.float32,
            LayerOps(),
            local_experts=[0, 8],
        )


def tensor_parallel_rank(rank: int, method=None) -> FusedMoE:
    """Rank ``rank`` of two's layer, loaded from the same random experts as a one-rank layer,
    returning its output unreduced (building needs no communicator; neither does running)."""
    with tensor_parallel(TensorParallel(rank, 2)):
        method = method or unquantized(torch.float32)
        return loaded_moe(method, EXPERTS, 2, HIDDEN, INTERMEDIATE, True, reduce_results=False)[0]


def test_tensor_parallel_ranks_hold_an_intermediate_slice_and_sum_to_the_whole_layer():
    """Each of two ranks stores every expert's half of the intermediate dimension (its gate and
    up rows, its down columns); their partial outputs (``reduce_results=False``: the sum before
    the all-reduce) add up to the one-rank layer's."""
    x, logits = inputs(16, torch.float32, seed=4)
    whole, (gate_up, down), _ = loaded_moe(unquantized(torch.float32), EXPERTS, 2, HIDDEN, INTERMEDIATE, True)
    half = INTERMEDIATE // 2
    partials = []
    for rank in range(2):
        layer = tensor_parallel_rank(rank)
        assert layer.split
        rows = slice(rank * half, (rank + 1) * half)
        gate, up = gate_up.chunk(2, dim=1)
        torch.testing.assert_close(layer.gate_up.weight, torch.cat([gate[:, rows], up[:, rows]], dim=1))
        torch.testing.assert_close(layer.down.weight, down[:, :, rows].contiguous())
        partials.append(layer(x, logits))
    torch.testing.assert_close(partials[0] + partials[1], whole(x, logits), atol=2e-5, rtol=1e-5)


class WholeExperts(UnquantizedLinearMethod):
    """The plain method, as one (a v5 method, say) that declares no split of its experts."""

    name = "whole-experts"
    splits_experts = False


def test_a_method_that_does_not_split_experts_keeps_them_whole_on_every_rank():
    """Its experts are the whole layer's on every rank, run unreduced (the note says why)."""
    x, logits = inputs(8, torch.float32, seed=5)
    whole = loaded_moe(unquantized(torch.float32), EXPERTS, 2, HIDDEN, INTERMEDIATE, True)[0]
    layer = tensor_parallel_rank(1, WholeExperts(QuantContext(None, torch.float32, None)))
    assert not layer.split and layer.gate_up.weight.shape == (EXPERTS, 2 * INTERMEDIATE, HIDDEN)
    torch.testing.assert_close(layer(x, logits), whole(x, logits))
    note = expert_split_note(WholeExperts)
    assert "whole on every rank" in note and "declares no split" in note


class Block(torch.nn.Module):
    def __init__(self, local_experts=None):
        super().__init__()
        self.experts = FusedMoE(
            EXPERTS,
            2,
            HIDDEN,
            INTERMEDIATE,
            True,
            unquantized(torch.float32),
            torch.float32,
            LayerOps(),
            local_experts=local_experts,
        )


def checkpoint(names=("gate_proj", "up_proj", "down_proj")):
    gen = torch.Generator().manual_seed(3)
    shapes = {
        names[0]: (INTERMEDIATE, HIDDEN),
        names[1]: (INTERMEDIATE, HIDDEN),
        names[2]: (HIDDEN, INTERMEDIATE),
    }
    return {
        f"mlp.experts.{e}.{p}.weight": torch.randn(*shape, generator=gen)
        for e in range(EXPERTS)
        for p, shape in shapes.items()
    }


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
def test_checkpoint_experts_load_into_the_stacked_weights(names):
    model = torch.nn.Module()
    model.mlp = Block()
    tensors = checkpoint(names)
    load_checkpoint(model, tensors.items())
    torch.testing.assert_close(
        model.mlp.experts.gate_up.weight[5, :INTERMEDIATE], tensors[f"mlp.experts.5.{names[0]}.weight"]
    )
    torch.testing.assert_close(
        model.mlp.experts.gate_up.weight[5, INTERMEDIATE:], tensors[f"mlp.experts.5.{names[1]}.weight"]
    )
    torch.testing.assert_close(model.mlp.experts.down.weight[7], tensors[f"mlp.experts.7.{names[2]}.weight"])


def test_other_ranks_experts_are_skipped_and_missing_ones_refused():
    model = torch.nn.Module()
    model.mlp = Block(local_experts=[6, 1])
    tensors = checkpoint()
    load_checkpoint(model, tensors.items())
    torch.testing.assert_close(
        model.mlp.experts.gate_up.weight[0, :INTERMEDIATE], tensors["mlp.experts.6.gate_proj.weight"]
    )
    torch.testing.assert_close(model.mlp.experts.down.weight[1], tensors["mlp.experts.1.down_proj.weight"])
    model.mlp.experts.gate_up.process_weights_after_loading()
    partial = torch.nn.Module()
    partial.mlp = Block()
    load_checkpoint(
        partial, [(k, v) for k, v in tensors.items() if not k.startswith("mlp.experts.3.up_proj")]
    )
    with pytest.raises(ValueError, match=r"\(3, 1\)"):
        partial.mlp.experts.gate_up.process_weights_after_loading()


def test_batch_invariant_mode_gives_a_row_the_same_bits_in_any_batch():
    """Under batch_invariant each expert runs its rows in fixed 16-row tiles: a token's output
    alone equals its output among 40 others bit for bit (the plain grouped path does not
    promise it)."""
    layer = loaded_moe(
        unquantized(torch.bfloat16, batch_invariant=True), EXPERTS, 2, HIDDEN, INTERMEDIATE, True
    )[0]
    x, logits = inputs(41, torch.bfloat16, seed=4)
    batched = layer(x, logits)
    for row in (0, 17, 40):
        assert torch.equal(layer(x[row : row + 1], logits[row : row + 1])[0], batched[row])
    _, _, (gate_up, down) = loaded_moe(unquantized(torch.bfloat16), EXPERTS, 2, HIDDEN, INTERMEDIATE, True)
    torch.testing.assert_close(
        batched.float(), reference_moe(x, logits, gate_up, down, 2, True), atol=3e-2, rtol=3e-2
    )


def _clamped(gate_up: torch.Tensor) -> torch.Tensor:
    """An activation other than SwiGLU (gpt-oss's shape of one): tanh(gate) · (up + 1)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.tanh(gate) * (up + 1)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_biased_experts_with_their_own_activation_match_a_per_expert_loop(batch_invariant):
    """``bias=True`` and ``activation=``: each row gets its own expert's biases on both
    projections (loaded as ``<e>.<projection>.bias``), in the grouped and the row-tile path."""
    gen = torch.Generator().manual_seed(3)
    layer = FusedMoE(
        EXPERTS,
        2,
        HIDDEN,
        INTERMEDIATE,
        False,
        unquantized(torch.float32, batch_invariant),
        torch.float32,
        LayerOps(),
        activation=_clamped,
        bias=True,
    )
    shapes = {"gate_proj": INTERMEDIATE, "up_proj": INTERMEDIATE, "down_proj": HIDDEN}
    inputs_of = {"gate_proj": HIDDEN, "up_proj": HIDDEN, "down_proj": INTERMEDIATE}
    weights = {
        (e, p, param): torch.randn(shapes[p], *([inputs_of[p]] if param == "weight" else []), generator=gen)
        for e in range(EXPERTS)
        for p in shapes
        for param in ("weight", "bias")
    }
    for (e, p, param), tensor in weights.items():
        layer.load_expert(p, param, e, tensor)
    x, logits = inputs(9, torch.float32, seed=4)
    weights_k, ids = torch.softmax(logits, -1).topk(2, dim=-1)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights_k[t], ids[t].tolist()):
            gate = x[t] @ weights[e, "gate_proj", "weight"].t() + weights[e, "gate_proj", "bias"]
            up = x[t] @ weights[e, "up_proj", "weight"].t() + weights[e, "up_proj", "bias"]
            hidden = _clamped(torch.cat([gate, up]))
            want[t] += w * (hidden @ weights[e, "down_proj", "weight"].t() + weights[e, "down_proj", "bias"])
    torch.testing.assert_close(layer(x, logits), want, atol=2e-4, rtol=1e-4)
