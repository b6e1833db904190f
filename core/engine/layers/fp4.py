"""FP4 (e2m1) weights with a float scale per block of inputs, the form NVFP4 and MXFP4 share.

An e2m1 code is 4 bits: a sign, two exponent bits and one mantissa bit, the values
{0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives (:data:`E2M1`). Checkpoints store two codes a
byte, the even element in the low nibble. NVFP4 scales each block of 16 by a float8 e4m3 scale
over a per-tensor float32 global scale; MXFP4 each block of 32 by a power of two (E8M0). Both are
exactly ``w = E2M1[code] · scale`` with ``scale`` one float32 per block (NVFP4's
``e4m3 / global`` as its reference computes it), which :class:`Fp4Weight` holds: the plain-math
reference (``dequantize``) and what a platform's FP4 kernel packs
(:meth:`engine.layers.LayerOps.pack_fp4`).

An e4m3 scale is not a power of two, so unlike MXFP4 an NVFP4 block does not fold into an
integer group-affine weight of 8 bits or fewer (``engine.layers.group_affine``) without error:
the scale has to stay a float beside the codes.
"""

from __future__ import annotations

import attrs
import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2], two codes a byte (the even element low) -> int64 codes [N, K]."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()


@attrs.frozen
class Fp4Weight:
    packed: torch.Tensor  # uint8 [N, K/2]: codes of inputs 2i (low nibble) and 2i + 1 (high)
    scale: torch.Tensor  # float32 [N, K // block]
    block: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.shape
        values = E2M1[unpack_codes(self.packed)].view(rows, -1, self.block) * self.scale[..., None]
        return values.view(rows, cols).to(dtype)

    @staticmethod
    def cat(parts: list[Fp4Weight]) -> Fp4Weight:
        """Stack along the output rows (fused projections); block sizes must agree."""
        if any(p.block != parts[0].block for p in parts):
            raise ValueError("cannot fuse FP4 weights of different block sizes")
        return Fp4Weight(
            torch.cat([p.packed for p in parts]), torch.cat([p.scale for p in parts]), parts[0].block
        )
