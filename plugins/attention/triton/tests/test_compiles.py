"""The kernel compiled ahead of time for NVIDIA GPUs by Triton's CUDA backend and its bundled
ptxas, with no device: what the interpreter cannot check — that every construct lowers (a
module global read inside the kernel runs interpreted but does not compile) and that the
tl.dot shapes are legal — for the decode and prefill launches of a 16-bit and a float32 spec,
on Ampere and Hopper. Nothing is run."""

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.builtin.platforms import CpuPlatform
from engine.interfaces import AttentionSpec
from engine_attention_triton.backend import DECODE_LANES, PREFILL_LANES, TritonAttentionBackend, interpreted
from engine_attention_triton.kernel import paged_attention_kernel

_POINTEE = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def compile_launch(backend: TritonAttentionBackend, rows: int, arch: int):
    names = paged_attention_kernel.arg_names
    data = _POINTEE[backend.spec.dtype]
    signature = {n: data if n in ("out_ptr", "q_ptr", "cache_ptr") else "*i32" for n in names[:8]}
    signature.update({n: "i32" for n in names[8:17]}, scale="fp32", softcap="fp32", window="i32")
    constexprs = backend.constexprs(rows)
    signature.update({n: "constexpr" for n in constexprs})
    source = ASTSource(
        paged_attention_kernel,
        signature,
        constexprs={(names.index(n),): value for n, value in constexprs.items()},
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32))


@pytest.mark.skipif(interpreted(), reason="TRITON_INTERPRET=1 replaces the kernel by its interpreted form")
@pytest.mark.parametrize(
    "spec, arch",
    [
        (
            AttentionSpec(
                num_heads=8,
                num_kv_heads=2,
                head_dim=64,
                dtype=torch.bfloat16,
                block_size=16,
                sliding_window=32,
                logit_softcap=30.0,
            ),
            90,
        ),
        (AttentionSpec(num_heads=4, num_kv_heads=4, head_dim=64, dtype=torch.float32, block_size=32), 80),
    ],
    ids=["bf16-gqa-window-softcap-sm90", "fp32-mha-sm80"],
)
def test_kernel_compiles_for_nvidia_gpus(spec, arch):
    backend = TritonAttentionBackend(spec, CpuPlatform())
    for lanes in (DECODE_LANES, PREFILL_LANES):
        compiled = compile_launch(backend, backend.tile_rows(lanes), arch)
        assert "cubin" in compiled.asm and compiled.metadata.shared < 100 * 1024
