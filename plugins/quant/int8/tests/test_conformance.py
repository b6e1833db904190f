"""The quant-method conformance kit for both int8 modes, plus their refusal off the CPU."""

import pytest

from engine.testing.quant import QuantMethodContract


class FakeCuda:
    name, device_type = "cuda", "cuda"


class TestInt8WeightOnly(QuantMethodContract):
    method = "int8-w8a16"
    quant_error = 0.01  # half a step of 1/127 of the row's max, plus bf16 rounding
    logprob_atol = 0.02

    def refusals(self):
        from engine_quant_int8.method import Int8WeightOnly

        return [lambda: Int8WeightOnly.supports(FakeCuda())]


class TestInt8Dynamic(TestInt8WeightOnly):
    method = "int8-w8a8"
    apply_rtol = 3e-2  # activations are rounded to int8 too
    logprob_atol = 0.03


def test_w8a8_keeps_outlier_channels_out_of_the_int8_product():
    """One input channel 100× the others: rounded into each row's int8 scale it would leave
    the rest ~1 step wide; multiplied in float, the output stays within int8 rounding."""
    import torch

    from engine.layers.int8 import OUTLIER_THRESHOLD, Int8Rows

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen) * 0.1
    x = torch.randn(8, 64, generator=gen)
    x[:, 3] = 100.0
    assert x.abs().amax() > OUTLIER_THRESHOLD
    rows = Int8Rows.from_float(weight, torch.float32)
    expected = x @ rows.dequantize().t()
    error = (rows.forward_dynamic(x) - expected).abs().max() / expected.abs().max()
    assert error < 0.01


@pytest.mark.parametrize("platform", ["cpu", "cpu-native"])
def test_w8a8_rows_keep_their_bits_beside_other_rows_outliers(platform):
    """Under ``--batch-invariant`` (``own_outliers``, 16-row tiles) a row's outlier channels are
    its own: every row of a tile whose rows have outliers in different channels gives the bits
    it gets in a tile of its own. With the tile's channels shared (the default mode) some row
    does not: the check sees the effect."""
    import torch

    from engine.layers.batch_invariant import in_row_tiles
    from engine.layers.int8 import Int8Rows
    from engine.plugins import load_plugins

    ops = load_plugins().get("platforms", platform)().layer_ops(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    rows = Int8Rows.from_float(torch.randn(48, 64, generator=gen) * 0.1, torch.bfloat16, ops)
    x = torch.randn(16, 64, generator=gen)
    for row, channel in ((0, 3), (2, 9), (5, 40)):
        x[row, channel] = 30.0
    x = x.bfloat16()

    def tiled(rows_of_x, own_outliers):
        return in_row_tiles(lambda tile: rows.forward_dynamic(tile, own_outliers), rows_of_x)

    for own_outliers, same in ((True, True), (False, False)):
        together = tiled(x, own_outliers)
        alone = torch.cat([tiled(x[i : i + 1], own_outliers) for i in range(16)])
        assert torch.equal(together, alone) == same
