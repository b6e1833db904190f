"""``engine serve --dry-run`` plans an AWQ or GPTQ checkpoint's weights at the kernels the loaded
layers hold (``QuantMethod.planned_kernel``: the packed kernel or int4pack planes this platform
picks), not at the float tensors a meta model would have: within 10% of the loaded bytes."""

import pytest

from engine.testing import reference
from engine.testing.quant import TINY_LLAMA, assert_planned_as_loaded, write_quantized_checkpoint
from engine_quant_awq_gptq import checkpoint

FORMATS = {
    "awq": (lambda w: checkpoint.awq_tensors(w, 128), checkpoint.awq_config(128)),
    "gptq-act-order": (
        lambda w: checkpoint.gptq_tensors(w, 4, 128, True, True, False),
        checkpoint.gptq_config(4, 128, True, True, False),
    ),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_dry_run_plans_the_loaded_weights(tmp_path, fmt):
    quantize, config = FORMATS[fmt]
    reference.tiny_checkpoint(str(tmp_path / "hf"), "LlamaForCausalLM", TINY_LLAMA, seed=0)
    write_quantized_checkpoint(str(tmp_path / "hf"), str(tmp_path / fmt), quantize, config)
    assert_planned_as_loaded(str(tmp_path / fmt))
