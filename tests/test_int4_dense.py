"""Int4Planes from DENSE_ROWS rows up unpacks its weight and multiplies densely: the same
product as the int4 kernel's, for one and two planes and row counts the packing pads."""

import pytest
import torch

from engine.layers.group_affine import DENSE_ROWS, AffineWeight, Int4Planes, packed_rows_readable

pytestmark = pytest.mark.skipif(not packed_rows_readable(), reason="this torch packs int4 differently")


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("out_features", [64, 100])
def test_dense_product_matches_the_kernel(bits, out_features):
    gen = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 2**bits, (out_features, 96), generator=gen, dtype=torch.uint8)
    scale = torch.rand(out_features, 3, generator=gen) * 0.02
    offset = -torch.rand(out_features, 3, generator=gen) * 0.02 * 2 ** (bits - 1)
    weight = AffineWeight(q, scale, offset, 32, bits)
    planes = Int4Planes(weight, torch.bfloat16)
    x = torch.randn(DENSE_ROWS, 96, generator=gen).to(torch.bfloat16)
    dense = planes(x)  # DENSE_ROWS rows: the dense path
    kernel = torch.cat([planes(x[: DENSE_ROWS // 2]), planes(x[DENSE_ROWS // 2 :])])  # under it: the kernel
    assert dense.shape == (DENSE_ROWS, out_features)
    reference = x.double() @ weight.dequantize(torch.float64).t()
    tol = 0.01 * reference.abs().max().item()  # bf16 rounding of the output and of the weight
    for out in (dense, kernel):
        torch.testing.assert_close(out.double(), reference, atol=tol, rtol=0)
