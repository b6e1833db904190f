"""attention-torch against the core's attention contract."""

from engine.testing.attention import AttentionBackendContract


class TestTorchAttention(AttentionBackendContract):
    backend_name = "torch"
