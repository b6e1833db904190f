"""NVFP4 activations round as compressed-tensors' ``cast_to_fp4`` does: to the nearest e2m1
value, a value halfway between two to the one with the even code (0.25 -> 0, 0.75 -> 1,
2.5 -> 2, 3.5 -> 4, 5 -> 4), signs kept, beyond 6 saturated by the caller's clamp."""

import torch

from engine_quant_compressed_tensors.kernels import round_to_e2m1


def test_ties_go_to_the_even_code_and_the_rest_to_the_nearest_value():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 2.6, 5.1, 6.0, 0.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 3.0, 6.0, 6.0, 0.0])
    assert torch.equal(round_to_e2m1(x), want)
    assert torch.equal(round_to_e2m1(-x), -want)
