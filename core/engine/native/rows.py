"""Row reductions of the sampler in C (``rows.c``), over OpenMP's threads.

A greedy step's argmax reads every logit of every row once: at 256 rows of a 49k vocabulary
that is 50 MB, which numpy's argmax scans on one thread. :func:`argmax` splits the rows over
the threads; it returns None where the library cannot be built here (no C compiler), and the
caller keeps numpy's.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from engine.native import load_source
from engine.native.errors import BuildError

SOURCE = Path(__file__).with_name("rows.c")
logger = logging.getLogger(__name__)


@functools.cache
def _library():
    try:
        return load_source(SOURCE)
    except BuildError as error:
        logger.info("row argmax runs on numpy: %s", error)
        return None


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """Each row's first maximum (a NaN counting as the maximum) of a float32 CPU matrix whose
    rows are contiguous, as int64; None where the kernel does not take it."""
    library = _library()
    if library is None or logits.dtype != torch.float32 or logits.device.type != "cpu":
        return None
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    library.argmax_rows_f32(
        logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr()
    )
    return out
