"""What a tensor-parallel rank holds of a packed-integer layer, for AWQ, GPTQ and
compressed-tensors (which imports it): whether a layer being built is split, and the refusal of
sizes whose packing words a split would cut.

A rank's part of each checkpoint tensor is cut by the core (``engine.layers.parallel``) along
the dims the tensor declares (``output_dim``, ``input_dim``): the proportional slice, so a
packed dim keeps whole words and a grouped dim whole groups only when the rank's sizes are
multiples of them. The methods check those sizes when the layer is created — the sizes they
are given then are the rank's — so a bad split is refused at start-up naming the sizes, before
any tensor is read.
"""

from __future__ import annotations

from engine.distributed import current_tensor_parallel
from engine.layers.parallel import ColumnParallelLinear, RowParallelLinear


def split_dims(layer) -> tuple[bool, bool]:
    """Whether ``layer`` (being built) has its outputs and its inputs split over ranks."""
    if current_tensor_parallel().size == 1:
        return False, False
    return isinstance(layer, ColumnParallelLinear), isinstance(layer, RowParallelLinear)


def rank_note(split: tuple[bool, bool]) -> str:
    """What a refusal adds when the sizes it names are a rank's part of a layer."""
    return " (a tensor-parallel rank's part of a layer)" if any(split) else ""


def check_whole_words(
    method: str, per_word: int, input_size: int | None, output_sizes: list[int], split: tuple[bool, bool]
) -> None:
    """Refuse sizes a word of ``per_word`` packed values would straddle: ``input_size`` (None: the
    format does not pack along the inputs) and each of ``output_sizes`` (empty: nor along the
    outputs); ``split``: :func:`split_dims` of the layer, which these sizes are a rank's part of."""
    cut = [f"input size {input_size}"] if input_size is not None and input_size % per_word else []
    if any(size % per_word for size in output_sizes):
        cut.append(f"output sizes {output_sizes}")
    if cut:
        raise ValueError(
            f"quantization: {method} packs {per_word} values a word; {' and '.join(cut)}"
            f"{rank_note(split)} do not hold whole words"
        )
