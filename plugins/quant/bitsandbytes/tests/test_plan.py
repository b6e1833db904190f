"""``engine serve --dry-run`` plans a bitsandbytes 4-bit checkpoint's weights at what the loaded
layers hold (``QuantMethod.planned_kernel``: each weight dequantized to the activation dtype),
not at the meta model's sinks, which hold nothing: within 10% of the loaded bytes."""

from engine.testing import reference
from engine.testing.quant import TINY_LLAMA, planned_and_loaded_weights
from engine_quant_bitsandbytes.checkpoint import save_quantized

OPTIONS = dict(dtype="bfloat16", max_model_len=128, kv_cache_memory=8 * 2**20, block_size=16)


def test_the_dry_run_plans_the_loaded_weights(tmp_path):
    reference.tiny_checkpoint(str(tmp_path / "hf"), "LlamaForCausalLM", TINY_LLAMA, seed=0)
    save_quantized(str(tmp_path / "hf"), str(tmp_path / "nf4"), "nf4-double-quant")
    planned, loaded = planned_and_loaded_weights(str(tmp_path / "nf4"), **OPTIONS)
    assert abs(planned - loaded) <= 0.1 * loaded, (planned, loaded)
