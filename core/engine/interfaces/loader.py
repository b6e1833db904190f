"""ModelLoader: a checkpoint format. It yields the HF config, the tokenizer and the
weights under their HF names, so model plugins never see the file format."""

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar


class ModelLoader(ABC):
    name: ClassVar[str]

    def __init__(self, path: str):
        self.path = path

    @classmethod
    @abstractmethod
    def detect(cls, path: str) -> list[str]:
        """Reasons this loader cannot read ``path``; empty when it can."""

    @classmethod
    def default_model(cls) -> str | None:
        """A model this plugin ships, used when the user names none."""
        return None

    @abstractmethod
    def hf_config(self) -> Any:
        """A ``transformers.PretrainedConfig``."""

    @abstractmethod
    def tokenizer(self) -> Any | None:
        """A ``transformers`` tokenizer, or None when the checkpoint has none."""

    @abstractmethod
    def iter_weights(self, hf_config: Any, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
        """(HF parameter name, tensor) pairs; show progress for long loads.

        ``keep_quantized`` is set when the selected quant method is the one ``quant_config``
        names: a loader whose format stores quantized blocks may then yield them in its own
        documented form for that method. Without it, every tensor is a float tensor."""

    def iter_weight_slices(self, hf_config: Any, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
        """(HF parameter name, tensor or :class:`engine.layers.checkpoint.CheckpointSlice`)
        pairs for a tensor-parallel rank, which reads only its part of each weight through
        a slice (``narrow`` in the logical [out, in] coordinates of the weight; what it
        returns is what ``iter_weights`` would yield for that part, in its kept-quantized
        form with ``keep_quantized``). This default yields ``iter_weights``' tensors whole
        (each rank then reads the whole checkpoint). A loader that counts what it reads sets
        ``bytes_read``. Interface v3 passes ``keep_quantized``; a v2 loader's override is
        called without it (v2 quant methods never kept a file quantized under several ranks)."""
        yield from self.iter_weights(hf_config, keep_quantized)

    def generation_config(self) -> dict | None:
        """The checkpoint's generation config (Hugging Face ``generation_config.json`` keys:
        ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
        ``max_new_tokens`` ...), or None when it has none. The engine takes its default
        sampling parameters from it under ``--generation-config auto``."""
        return None

    def quant_config(self) -> dict | None:
        """The checkpoint's quantization config, if any."""
        return None
