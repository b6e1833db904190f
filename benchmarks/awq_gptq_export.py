"""The default model's weights exported as AWQ and GPTQ checkpoints (4 bits, groups of 32),
built once and cached under the GGUF cache folder, for ``quant.py``'s side-by-side rows.

    python benchmarks/awq_gptq_export.py [awq|gptq ...]

The GGUF file's weights are dequantized to bf16 and saved as a Hugging Face folder with the
file's tokenizer (``vs_vllm.hf_folder``, the folder vLLM loads there), and every linear weight
is packed by the awq-gptq plugin's reference packers (``engine_quant_awq_gptq.checkpoint``: AWQ GEMM with
zero points, GPTQ v1 symmetric). The tied embedding stays bf16, as AWQ/GPTQ checkpoints keep it.
"""

from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))

AWQ, GPTQ = "awq", "gptq"
GROUP = 32
EXPORT_VERSION = 1  # part of the folder names: bump when the export changes


def _quantizers():
    from engine_quant_awq_gptq import checkpoint

    return {
        AWQ: (lambda w: checkpoint.awq_tensors(w, GROUP), checkpoint.awq_config(GROUP)),
        GPTQ: (lambda w: checkpoint.gptq_tensors(w, 4, GROUP), checkpoint.gptq_config(4, GROUP)),
    }


FORMATS = (AWQ, GPTQ)


def build(name: str) -> str:
    """The folder of the default model's weights in format ``name`` (written now if missing)."""
    from vs_vllm import hf_folder

    from engine.testing.quant import write_quantized_checkpoint
    from engine_quant_gguf.loader import cache_dir

    folder = os.path.join(cache_dir(), f"smollm2-{name}-g{GROUP}-v{EXPORT_VERSION}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        quantize, config = _quantizers()[name]
        tmp = f"{folder}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        write_quantized_checkpoint(hf_folder(), tmp, quantize, config)
        os.replace(tmp, folder)
    return folder


if __name__ == "__main__":
    for name in sys.argv[1:] or FORMATS:
        print(name, build(name))
