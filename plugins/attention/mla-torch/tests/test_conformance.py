"""attention-mla-torch against the core's latent attention contract, on both of its paths."""

import pytest
import torch

from engine.testing.attention import BATCHES
from engine.testing.latent_attention import LatentAttentionContract, latent_spec, run_latent_calls


class TestMLATorch(LatentAttentionContract):
    backend_name = "mla-torch"


class TestPaths:
    """The absorbed and the naive path compute the same attention: decode rows forced down the
    naive path give the absorbed path's output, and each path is handed the rows it claims."""

    @pytest.mark.parametrize("batch", ["decode", "mixed"])
    def test_forced_naive_equals_absorbed(self, batch):
        contract = TestMLATorch()
        spec = latent_spec(torch.float32, 8)
        outputs = {}
        for path in ("absorbed", "naive"):
            backend = contract.backend(spec)
            backend.decode_path = path
            outputs[path] = [out for out, _ in run_latent_calls(backend, spec, BATCHES[batch], 64)]
            # one-row requests of both calls: a cached context of 1 token, then the new rows
            decode_rows = sum((ctx == 1) + (n == 1) for ctx, n in BATCHES[batch])
            assert backend.path_rows["absorbed"] == (decode_rows if path == "absorbed" else 0)
        for absorbed, naive in zip(outputs["absorbed"], outputs["naive"]):
            torch.testing.assert_close(absorbed, naive, atol=1e-5, rtol=1e-5)

    def test_unknown_decode_path_is_refused(self):
        backend = TestMLATorch().backend(latent_spec(torch.float32, 8))
        with pytest.raises(ValueError, match="decode_path: 'fast' is not one of absorbed, naive"):
            type(backend)(backend.spec, backend.platform, decode_path="fast")
