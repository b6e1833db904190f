"""``engine serve --dry-run`` plans a bitsandbytes 4-bit checkpoint's weights at what the loaded
layers hold (``QuantMethod.planned_kernel``: each weight dequantized to the activation dtype),
not at the meta model's sinks, which hold nothing: within 10% of the loaded bytes."""

from engine.testing import reference
from engine.testing.quant import TINY_LLAMA, assert_planned_as_loaded
from engine_quant_bitsandbytes.checkpoint import save_quantized


def test_the_dry_run_plans_the_loaded_weights(tmp_path):
    reference.tiny_checkpoint(str(tmp_path / "hf"), "LlamaForCausalLM", TINY_LLAMA, seed=0)
    save_quantized(str(tmp_path / "hf"), str(tmp_path / "nf4"), "nf4-double-quant")
    assert_planned_as_loaded(str(tmp_path / "nf4"))
