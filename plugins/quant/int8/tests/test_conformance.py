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
