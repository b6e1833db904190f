"""The Hugging Face folder format: config.json, tokenizer files, (sharded) safetensors."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from engine.interfaces import ModelLoader


class SafetensorsLoader(ModelLoader):
    name = "safetensors"

    @classmethod
    def detect(cls, path: str) -> list[str]:
        if not os.path.isdir(path):
            return [f"{path!r} is not a directory"]
        reasons = []
        if not os.path.isfile(os.path.join(path, "config.json")):
            reasons.append("no config.json")
        if not glob.glob(os.path.join(path, "*.safetensors")):
            reasons.append("no *.safetensors files")
        return reasons

    def hf_config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path)

    def tokenizer(self):
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any(os.path.isfile(os.path.join(self.path, n)) for n in names):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def generation_config(self) -> dict | None:
        from engine.generation_config import read_generation_config

        return read_generation_config(self.path)

    def quant_config(self) -> dict | None:
        with open(os.path.join(self.path, "config.json")) as f:
            return json.load(f).get("quantization_config")

    def iter_weights(self, hf_config, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors as stored: a quantized checkpoint's weights (FP8, packed FP4) and scales
        come as the separate tensors its quant method registers, whatever ``keep_quantized``."""
        files = sorted(glob.glob(os.path.join(self.path, "*.safetensors")))
        handles = [safe_open(f, framework="pt") for f in files]
        total = sum(len(list(h.keys())) for h in handles)
        with tqdm(total=total, desc="Loading safetensors", unit="tensor", leave=False) as bar:
            for handle in handles:
                for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    yield name, handle.get_tensor(name)
                    bar.update()
