"""The Triton MXFP4 kernel under the interpreter, against dequantize-then-matmul. Run in a
child process: ``TRITON_INTERPRET=1`` must be set before the kernel is decorated, and must
not leak into other tests."""

import os
import subprocess
import sys

CHECK = """
import torch
from engine_quant_mxfp4.format import dequantize, quantize
from engine_quant_mxfp4.triton_kernel import mxfp4_matmul

gen = torch.Generator().manual_seed(0)
for m, n, k in [(1, 32, 64), (5, 48, 96), (17, 64, 128)]:
    tensors = quantize(torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(m, k, generator=gen)
    got = mxfp4_matmul(x, tensors["weight_blocks"], tensors["weight_scales"])
    want = x @ dequantize(tensors["weight_blocks"], tensors["weight_scales"]).T
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
print("ok")
"""


def test_kernel_matches_dequantize_then_matmul_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_cuda_takes_the_triton_path():
    from engine_quant_mxfp4.method import Mxfp4LinearMethod

    class Cuda:
        name, device_type = "cuda", "cuda"

    assert "Triton" in Mxfp4LinearMethod.describe(Cuda())
