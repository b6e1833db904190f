"""The default model's weights exported as AWQ and GPTQ checkpoints (4 bits, groups of 32),
and as a GGUF Q4_1 file whose vocabulary table stays float as theirs does, built once and
cached under the GGUF cache folder, for ``quant.py``'s side-by-side rows.

    python benchmarks/awq_gptq_export.py [awq|gptq|gguf-float-vocab ...]

The GGUF file's weights are dequantized to bf16 and saved as a Hugging Face folder with the
file's tokenizer (``vs_vllm.hf_folder``, the folder vLLM loads there), and every linear weight
is packed by the awq-gptq plugin's reference packers (``engine_quant_awq_gptq.checkpoint``: AWQ GEMM with
zero points, GPTQ v1 symmetric). The tied embedding stays bf16, as AWQ/GPTQ checkpoints keep it.
The GGUF file (``gguf-float-vocab``) holds the same bf16 folder's linear weights as Q4_1 (re-rounding
the default file's own Q4_1 values) and its vocabulary table in float: the same weights as the
AWQ/GPTQ checkpoints, where the default file keeps that table as Q8_0.
"""

from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))

AWQ, GPTQ, GGUF_FLOAT_VOCAB = "awq", "gptq", "gguf-float-vocab"
GROUP = 32
EXPORT_VERSION = 1  # part of the folder names: bump when the export changes


def _quantizers():
    from engine_quant_awq_gptq import checkpoint

    return {
        AWQ: (lambda w: checkpoint.awq_tensors(w, GROUP), checkpoint.awq_config(GROUP)),
        GPTQ: (lambda w: checkpoint.gptq_tensors(w, 4, GROUP), checkpoint.gptq_config(4, GROUP)),
    }


FORMATS = (AWQ, GPTQ, GGUF_FLOAT_VOCAB)


def build(name: str) -> str:
    """The folder (or file) of the default model's weights in format ``name`` (written now if
    missing)."""
    from vs_vllm import hf_folder

    from engine.testing.quant import write_quantized_checkpoint
    from engine_quant_gguf.loader import cache_dir

    if name == GGUF_FLOAT_VOCAB:
        return _gguf_float_vocab(
            os.path.join(cache_dir(), f"smollm2-q4_1-float-vocab-v{EXPORT_VERSION}.gguf")
        )
    folder = os.path.join(cache_dir(), f"smollm2-{name}-g{GROUP}-v{EXPORT_VERSION}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        quantize, config = _quantizers()[name]
        tmp = f"{folder}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        write_quantized_checkpoint(hf_folder(), tmp, quantize, config)
        os.replace(tmp, folder)
    return folder


def _gguf_float_vocab(path: str) -> str:
    import types

    import torch
    from gguf import GGMLQuantizationType
    from transformers import AutoModelForCausalLM
    from vs_vllm import hf_folder

    from engine_quant_gguf.loader import default_model_path
    from engine_quant_gguf.writer import write_gguf

    if not os.path.isfile(path):
        model = AutoModelForCausalLM.from_pretrained(hf_folder(), dtype=torch.bfloat16)
        tied = types.SimpleNamespace(  # without the tied LM head's second name (one table in the file)
            config=model.config,
            state_dict=lambda: {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"},
        )
        tmp = f"{path}.tmp{os.getpid()}"
        write_gguf(
            tmp,
            tied,
            default_model_path(),
            GGMLQuantizationType.Q4_1,
            float_tensors={"model.embed_tokens.weight"},
        )
        os.replace(tmp, path)
    return path


if __name__ == "__main__":
    for name in sys.argv[1:] or FORMATS:
        print(name, build(name))
