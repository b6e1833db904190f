"""attention-cpu-native against the core's attention contract, with its AVX-512 kernel,
its portable C kernel, and with every prefill chunk in C (none handed to the torch backend)."""

import pytest

from engine.testing.attention import AttentionBackendContract
from engine_attention_cpu_native.backend import NativeAttentionBackend


class TestNativeAttention(AttentionBackendContract):
    backend_name = "cpu-native"


class TestPortableKernel(AttentionBackendContract):
    backend_name = "cpu-native"

    @pytest.fixture
    def backend_cls(self):
        class Portable(NativeAttentionBackend):
            portable = True

        return Portable


class TestEveryChunkInC(AttentionBackendContract):
    backend_name = "cpu-native"

    @pytest.fixture
    def backend_cls(self):
        class AllNative(NativeAttentionBackend):
            max_native_query_len = 1 << 30

        return AllNative
