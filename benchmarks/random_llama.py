"""Random-weight Llama models of a chosen shape, built once and cached, for benchmarks that need a
model larger than the embedded default (SmolLM2-135M) without downloading one.

    python benchmarks/random_llama.py [--shape 1b|tiny] [--seed 0] [--check]

The 1B-class shape is Llama-3.2-1B's (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate
8192, tied embeddings, rope theta 500000) with the default model's tokenizer (SmolLM2's, vocab
49152), so prompts, chat template and token ids are the default model's. Its weights are bf16, drawn
from a seeded generator, and saved three ways under the engine's cache folder:

- an HF folder (``config.json``, bf16 safetensors, the tokenizer): what vLLM and the engine's bf16
  config load;
- GGUF Q4_1 and Q4_0 files of the same weights, written by the gguf plugin's writer with the
  default model's tokenizer metadata: what the engine's default config (kept quantized) and
  llama.cpp load. Every 2-D tensor is quantized, the tied embedding/LM-head table included.

Rope scaling (Llama-3.2's ``llama3`` type) is left out, and the context is 8192 tokens: neither
changes the weights a decode step reads. ``--check`` loads the folder and each file in the engine
and generates a few tokens from each. Building the 1B model takes a few minutes and ~6 GiB of memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil

BUILD_VERSION = 1  # part of the cache key: bump when the weights a build draws change
QTYPES = ("Q4_1", "Q4_0")


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a Llama checkpoint's size depends on; the vocabulary is the default tokenizer's."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192
    vocab_size: int = 49152


LLAMA_3_2_1B = Shape("llama-3.2-1b-shape", 2048, 16, 32, 8, 8192)
TINY = Shape("tiny", 64, 2, 4, 2, 128)  # builds in seconds: for tests
SHAPES = {"1b": LLAMA_3_2_1B, "tiny": TINY}


@dataclasses.dataclass(frozen=True)
class Built:
    """Where one built model lives: its HF folder and a GGUF file per quantization type."""

    folder: str
    gguf: dict[str, str]


def build_root(shape: Shape, seed: int) -> str:
    """The cache folder of one (shape, seed): a hash in the name, so a changed shape or build
    rule never reuses an old build."""
    from engine_quant_gguf.loader import cache_dir

    key = json.dumps([dataclasses.asdict(shape), seed, BUILD_VERSION], sort_keys=True)
    return os.path.join(cache_dir(), f"random-{shape.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}")


def hf_config(shape: Shape):
    """A ``LlamaConfig`` of ``shape`` whose special token ids are the default model's (its tokenizer
    is the one saved beside the weights)."""
    from transformers import LlamaConfig

    from engine_quant_gguf.loader import GGUFLoader, default_model_path

    default = GGUFLoader(default_model_path()).hf_config()
    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=default.bos_token_id,
        eos_token_id=default.eos_token_id,
        pad_token_id=default.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )


def random_model(shape: Shape, seed: int = 0):
    """The bf16 model with its weights drawn so activations keep their scale: every projection
    N(0, 1/fan_in) (a unit-variance input gives a unit-variance output, so the residual stream grows
    only ~√(2·layers)), the tied table N(0, 1/hidden) (unit-variance logits from the final norm's
    unit-variance output), norms at one. ``transformers``' default std 0.02 would amplify the
    8192-wide down projection 1.8× a layer instead."""
    import torch
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = hf_config(shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu").to(torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # the tied head is the table: listed once
            if param.ndim == 1:
                param.fill_(1.0)
                continue
            std = 1 / math.sqrt(param.shape[1])
            param.copy_(torch.randn(param.shape, generator=generator).mul_(std))
    model.model.rotary_emb = LlamaRotaryEmbedding(config)  # its inv_freq was left empty on meta
    model.tie_weights()
    return model


class _TiedView:
    """What ``write_gguf`` reads of a model (``config``, ``state_dict()``), without the tied LM
    head's second name: a GGUF file without ``output.weight`` is a tied model to every loader,
    while one with it holds the table twice."""

    def __init__(self, model):
        self.config = model.config

        def state_dict():
            return {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}

        self.state_dict = state_dict


def _save_folder(model, folder: str) -> None:
    from engine_quant_gguf.loader import GGUFLoader, default_model_path

    tmp = f"{folder}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    GGUFLoader(default_model_path()).tokenizer().save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def _save_gguf(model, path: str, qtype: str, tokenizer_source) -> None:
    import gguf

    from engine_quant_gguf.writer import write_gguf

    tmp = f"{path}.tmp{os.getpid()}"
    write_gguf(tmp, _TiedView(model), tokenizer_source, getattr(gguf.GGMLQuantizationType, qtype))
    os.replace(tmp, path)


def build(shape: Shape = LLAMA_3_2_1B, seed: int = 0, root: str | None = None, qtypes=QTYPES) -> Built:
    """The HF folder and GGUF files of ``shape`` (built now only where missing; each written
    under a temporary name and renamed, so a reader never sees half of one)."""
    root = root or build_root(shape, seed)
    built = Built(os.path.join(root, "hf-bf16"), {q: os.path.join(root, f"model.{q}.gguf") for q in qtypes})
    missing_folder = not os.path.isfile(os.path.join(built.folder, "model.safetensors"))
    missing = [q for q, path in built.gguf.items() if not os.path.isfile(path)]
    if not missing_folder and not missing:
        return built
    os.makedirs(root, exist_ok=True)
    model = random_model(shape, seed) if missing_folder else _load_folder(built.folder)
    if missing_folder:
        _save_folder(model, built.folder)
    if missing:
        import gguf

        from engine_quant_gguf.loader import default_model_path

        vocabulary = gguf.GGUFReader(default_model_path())  # parsed once for every file
        for qtype in missing:
            _save_gguf(model, built.gguf[qtype], qtype, vocabulary)
    return built


def row_path(name: str) -> str:
    """The 1B-class model as the benchmarks name it: ``1b-bf16`` its bf16 HF folder, ``1b-q4_1``
    and ``1b-q4_0`` its GGUF files (built on first use)."""
    built = build()
    return built.folder if name == "1b-bf16" else built.gguf[name.split("-")[1].upper()]


def _load_folder(folder: str):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


def activation_scales(model, ids: list[int]) -> list[float]:
    """The standard deviation of the residual stream after the embedding and each layer, and of
    the logits, for one prompt: the builder's claim that activations keep their scale."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return [float(h.float().std()) for h in out.hidden_states] + [float(out.logits.float().std())]


def check(built: Built, max_tokens: int = 8) -> dict[str, list[int]]:
    """Generate greedily from the HF folder (bf16) and each GGUF file (kept quantized) in the
    engine: the proof that both load."""
    import gc

    from engine import LLM, SamplingParams

    tokens = {}
    for name, path in [("bf16", built.folder), *built.gguf.items()]:
        llm = LLM(path, dtype="bfloat16", max_model_len=512)
        out = llm.generate(["The lighthouse keeper"], SamplingParams(max_tokens=max_tokens, temperature=0))
        tokens[name] = out[0].outputs[0].token_ids
        del llm
        gc.collect()
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="1b", help="1b: Llama-3.2-1B's; tiny: tests'"
    )
    parser.add_argument("--seed", type=int, default=0, help="the generator the weights are drawn from")
    parser.add_argument("--check", action="store_true", help="load each in the engine and generate")
    args = parser.parse_args()
    built = build(SHAPES[args.shape], args.seed)
    print(f"HF folder: {built.folder}")
    for qtype, path in built.gguf.items():
        print(f"GGUF {qtype}: {path} ({os.path.getsize(path) / 2**20:.0f} MiB)")
    if args.check:
        for name, ids in check(built).items():
            print(f"  {name}: {ids}")


if __name__ == "__main__":
    main()
