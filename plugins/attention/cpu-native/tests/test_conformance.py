"""attention-cpu-native against the core's attention contract, with its AVX-512 kernel (every
row in C, the default), its portable C kernel, and with chunks over 8 rows handed to the torch
backend (``max_native_query_len``)."""

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


class TestLongChunksDelegated(AttentionBackendContract):
    backend_name = "cpu-native"

    @pytest.fixture
    def backend_cls(self):
        class Delegating(NativeAttentionBackend):
            max_native_query_len = 8
            chunk_invariant = False
            batch_invariant_capable = False

        return Delegating
