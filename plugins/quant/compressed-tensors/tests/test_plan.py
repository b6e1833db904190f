"""``engine serve --dry-run`` plans a compressed-tensors checkpoint's weights at the kernels the
loaded layers hold (``planned_kernel``: its scheme's kernel built on zero tensors of each layer's
shape), not at the meta model's sinks, which hold nothing: within 10% of the loaded bytes."""

import pytest

from engine.testing import reference
from engine.testing.quant import TINY_LLAMA, assert_planned_as_loaded, write_quantized_checkpoint
from engine_quant_compressed_tensors import checkpoint

FORMATS = {
    "w4a16": (
        lambda w: checkpoint.packed_tensors(w, 4, 128),
        checkpoint.config("pack-quantized", checkpoint.int_weights(4, 128)),
    ),
    "nvfp4a16": (
        checkpoint.nvfp4_tensors,
        checkpoint.config("nvfp4-pack-quantized", checkpoint.NVFP4_WEIGHTS),
    ),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_dry_run_plans_the_loaded_weights(tmp_path, fmt):
    quantize, config = FORMATS[fmt]
    reference.tiny_checkpoint(str(tmp_path / "hf"), "LlamaForCausalLM", TINY_LLAMA, seed=0)
    write_quantized_checkpoint(str(tmp_path / "hf"), str(tmp_path / fmt), quantize, config)
    assert_planned_as_loaded(str(tmp_path / fmt))
