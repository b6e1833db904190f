"""The attention contract for the Triton backend, run on CPU tensors by Triton's interpreter.
Not collected by itself (``TRITON_INTERPRET=1`` must be set before the kernel is decorated,
and must not leak into other tests): ``test_conformance.py`` runs it in a child process.
By hand: ``TRITON_INTERPRET=1 pytest plugins/attention/triton/tests/interpreted_contract.py``."""

from engine.testing.attention import AttentionBackendContract


class TestTritonInterpreted(AttentionBackendContract):
    """The interpreter runs each program in Python (seconds a batch), so the kit is narrowed to
    under a minute: the smallest and largest block sizes, the batches that are not covered by
    others (every call 1 is a whole-prompt prefill batch, checked; mixed has a later chunk
    beside decode rows, the long later chunk many tiles over a long prefix and decode rows over
    short and long contexts; bidirectional runs the chunked-prefill batch), and the kind that
    combines a window, a soft-cap and a query scale."""

    backend_name = "triton"
    block_sizes = (16, 64)
    batches = ("decode", "long-later-chunk", "mixed")
    kinds = ("window-softcap-scale",)
