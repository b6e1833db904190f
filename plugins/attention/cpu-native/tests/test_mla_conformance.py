"""mla-cpu-native against the core's latent attention contract, with its AVX2 kernel and its
portable C kernel (decode rows in C, the other rows through mla-torch)."""

from engine.testing.latent_attention import LatentAttentionContract


class TestMLANative(LatentAttentionContract):
    backend_name = "mla-cpu-native"


class TestMLAPortableKernel(LatentAttentionContract):
    backend_name = "mla-cpu-native"

    def variant(self, cls):
        class Portable(cls):
            portable = True

        return Portable
