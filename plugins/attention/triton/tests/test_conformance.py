"""attention-triton against the core's attention contract, and a tiny Llama's greedy tokens
against the torch backend's, under ``TRITON_INTERPRET=1`` (one child process: the variable
must be set before the kernel is decorated and must not leak into other tests); and the
reasons it gives where it cannot run."""

import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from engine.builtin.platforms import CpuPlatform, CudaPlatform
from engine.interfaces import AttentionSpec
from engine_attention_triton.backend import TritonAttentionBackend

HERE = Path(__file__).parent


def test_contract_and_greedy_parity_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            str(HERE / "interpreted_contract.py"),
            str(HERE / "interpreted_parity.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=HERE.parents[3],
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1]


SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16)


def test_refuses_the_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reasons = TritonAttentionBackend.supports(SPEC, CpuPlatform())
    assert any("TRITON_INTERPRET=1" in r for r in reasons)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reasons given without a CUDA device")
def test_refuses_cuda_without_a_device():
    assert any("no CUDA device" in r for r in TritonAttentionBackend.supports(SPEC, CudaPlatform()))


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("block_size", 8, "block size 8"),
        ("block_size", 24, "block size 24"),
        ("dtype", torch.float64, "dtype"),
        ("head_dim", 512, "head size 512"),
        ("num_kv_heads", 3, "not a multiple"),
    ],
)
def test_reasons_name_what_it_refuses(monkeypatch, field, value, reason):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reasons = TritonAttentionBackend.supports(attrs.evolve(SPEC, **{field: value}), CpuPlatform())
    assert len(reasons) == 1 and reason in reasons[0]
