"""attention-sdpa against the core's attention contract: prefill, decode, mixed and chunked
batches, MHA and GQA, block sizes 8 and 16, float32 and bfloat16, against plain math."""

from engine.testing.attention import AttentionBackendContract


class TestSdpaAttention(AttentionBackendContract):
    backend_name = "sdpa"
