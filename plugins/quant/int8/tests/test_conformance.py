"""The quant-method conformance kit for both int8 modes, plus their refusal off the CPU."""

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
