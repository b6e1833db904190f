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
from engine.layers.checkpoint import CheckpointSlice


class SafetensorsSlice(CheckpointSlice):
    """One tensor of an open safetensors file, read on demand (``safe_open(...).get_slice``);
    the bytes read add up in ``loader.bytes_read``."""

    def __init__(self, handle, name: str, loader: SafetensorsLoader):
        self._slice, self._loader = handle.get_slice(name), loader

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._count(self._slice[index])

    def full(self) -> torch.Tensor:
        return self._count(self._slice[...] if not self.shape else self._slice[:])

    def _count(self, tensor: torch.Tensor) -> torch.Tensor:
        self._loader.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


class SafetensorsLoader(ModelLoader):
    name = "safetensors"
    bytes_read = 0  # by iter_weight_slices' slices

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
        from engine.messages.generation_config import read_generation_config

        return read_generation_config(self.path)

    def quant_config(self) -> dict | None:
        with open(os.path.join(self.path, "config.json")) as f:
            return json.load(f).get("quantization_config")

    def iter_weights(self, hf_config, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors as stored: a quantized checkpoint's weights (FP8, packed FP4) and scales
        come as the separate tensors its quant method registers, whatever ``keep_quantized``."""
        for handle, name in self._names():
            yield name, handle.get_tensor(name)

    def iter_weight_slices(
        self, hf_config, keep_quantized: bool = False
    ) -> Iterator[tuple[str, SafetensorsSlice]]:
        for handle, name in self._names():
            yield name, SafetensorsSlice(handle, name, self)

    def _names(self):
        files = sorted(glob.glob(os.path.join(self.path, "*.safetensors")))
        handles = [safe_open(f, framework="pt") for f in files]
        total = sum(len(list(h.keys())) for h in handles)
        with tqdm(total=total, desc="Loading safetensors", unit="tensor", leave=False) as bar:
            for handle in handles:
                for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    yield handle, name
                    bar.update()
