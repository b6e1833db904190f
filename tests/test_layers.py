"""Shared layers against plain math."""

import pytest
import torch

from engine.layers import LayerOps, RMSNorm, RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rms_norm_both_forms_match_plain_math(dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    x, residual = (torch.randn(tokens, 96, generator=gen).to(dtype) for _ in range(2))
    norm = RMSNorm(96, 1e-5, dtype)
    norm.weight.data = torch.rand(96, generator=gen).to(dtype) + 0.5
    h = x.float() + residual.float()
    want = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-5) * norm.weight.float()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    plain, summed = norm(x, residual)  # before loading ends: rms_norm
    norm.process_weights_after_loading()
    mirrored, _ = norm(x, residual)  # after: the layer norm of [h, -h]
    for got in (plain, mirrored):
        torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(summed, x + residual)


@pytest.mark.parametrize("tokens", [1, 9])
def test_qk_norm_rotary_matches_transformers_qwen3(tokens):
    """The per-head q/k RMSNorm then rotary of ``LayerOps.qk_norm_rotary`` is Qwen3's:
    transformers' own ``Qwen3RMSNorm`` and ``apply_rotary_pos_emb`` on the same q|k|v rows."""
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3 as hf

    heads, kv_heads, head_dim = 4, 2, 48
    config = Qwen3Config(
        hidden_size=64,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=128,
    )
    gen = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    norms = []
    for _ in range(2):
        norm = RMSNorm(head_dim, config.rms_norm_eps, torch.float32)
        norm.weight.data = torch.rand(head_dim, generator=gen) + 0.5
        norm.process_weights_after_loading()
        norms.append(norm)
    cos_sin = RotaryEmbedding(config, 128, torch.float32)(positions)
    q, k, v = LayerOps().qk_norm_rotary(qkv.clone(), *norms, heads, kv_heads, head_dim, cos_sin)

    hf_q, hf_k, hf_v = qkv.view(1, tokens, -1, head_dim).split([heads, kv_heads, kv_heads], dim=2)
    hf_norms = [hf.Qwen3RMSNorm(head_dim, config.rms_norm_eps) for _ in norms]
    for hf_norm, norm in zip(hf_norms, norms):
        hf_norm.weight.data = norm.weight.data.clone()
    cos, sin = hf.Qwen3RotaryEmbedding(config)(qkv, positions[None])
    want_q, want_k = hf.apply_rotary_pos_emb(
        hf_norms[0](hf_q).transpose(1, 2), hf_norms[1](hf_k).transpose(1, 2), cos, sin
    )
    torch.testing.assert_close(q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert torch.equal(v, hf_v[0])


@pytest.mark.parametrize("family", ["phi3", "glm4"])  # rotate-half and interleaved pairs
@pytest.mark.parametrize("tokens", [1, 9])
def test_partial_rotary_qkv_matches_transformers(family, tokens):
    """``LayerOps.partial_rotary_qkv`` rotates the first partial_rotary_factor of each q and k
    head as transformers' Phi-3 (halves) and GLM-4 (neighbouring pairs) ``apply_rotary_pos_emb``
    do, and leaves the other dims and v as they are."""
    from transformers import AutoConfig
    from transformers.models.glm4 import modeling_glm4
    from transformers.models.phi3 import modeling_phi3

    hf = {"phi3": modeling_phi3, "glm4": modeling_glm4}[family]
    heads, kv_heads, head_dim = 4, 2, 32
    config = AutoConfig.for_model(
        family,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        partial_rotary_factor=0.5,
        max_position_embeddings=128,
    )
    gen = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    cos_sin = RotaryEmbedding(config, 128, torch.float32)(positions)
    interleaved = family == "glm4"
    q, k, v = LayerOps().partial_rotary_qkv(qkv.clone(), heads, kv_heads, head_dim, cos_sin, interleaved)

    hf_q, hf_k, hf_v = qkv.view(1, tokens, -1, head_dim).split([heads, kv_heads, kv_heads], dim=2)
    rotary = {"phi3": modeling_phi3.Phi3RotaryEmbedding, "glm4": modeling_glm4.Glm4RotaryEmbedding}[family]
    cos, sin = rotary(config)(qkv, positions[None])
    assert cos.shape[-1] == head_dim // 2
    want_q, want_k = hf.apply_rotary_pos_emb(hf_q.transpose(1, 2), hf_k.transpose(1, 2), cos, sin)
    torch.testing.assert_close(q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert torch.equal(v, hf_v[0])


def test_split_fused_cuts_lazy_slices_reading_only_the_rows_asked_for(tmp_path):
    """``split_fused`` turns a fused q|k|v and gate|up into their parts' names, as tensors or,
    over a loader's lazy slices, as lazy parts: a rank narrowing a part reads only those rows."""
    from safetensors.torch import save_file

    from engine.builtin.safetensors_loader import SafetensorsLoader
    from engine.layers import split_fused
    from engine.layers.checkpoint import materialize

    qkv, gate_up = torch.randn(8 + 4 + 4, 6), torch.randn(2 * 5, 6)
    save_file(
        {"l.attn.qkv_proj.weight": qkv, "l.mlp.gate_up_proj.weight": gate_up}, tmp_path / "w.safetensors"
    )
    parts = {
        "qkv_proj": [("q_proj", 8), ("k_proj", 4), ("v_proj", 4)],
        "gate_up_proj": [("gate_proj", 5), ("up_proj", 5)],
    }
    loader = SafetensorsLoader(str(tmp_path))
    cut = dict(split_fused(loader.iter_weight_slices(None), parts))
    assert loader.bytes_read == 0
    expected = {
        "l.attn.q_proj.weight": qkv[:8],
        "l.attn.k_proj.weight": qkv[8:12],
        "l.attn.v_proj.weight": qkv[12:],
        "l.mlp.gate_proj.weight": gate_up[:5],
        "l.mlp.up_proj.weight": gate_up[5:],
    }
    assert set(cut) == set(expected)
    torch.testing.assert_close(cut["l.attn.k_proj.weight"].narrow(0, 1, 2), qkv[9:11], rtol=0, atol=0)
    assert loader.bytes_read == 2 * 6 * 4  # two rows of six float32
    plain = dict(
        split_fused([("l.attn.qkv_proj.weight", qkv), ("l.mlp.gate_up_proj.weight", gate_up)], parts)
    )
    for name, rows in expected.items():
        torch.testing.assert_close(materialize(cut[name]), rows, rtol=0, atol=0)
        torch.testing.assert_close(plain[name], rows, rtol=0, atol=0)


def test_split_fused_refuses_a_fused_tensor_it_cannot_cut():
    """A quantized checkpoint's packed tensor (here GPTQ's ``qweight``, [in / 8, out]) is refused
    by name rather than cut along the wrong axis."""
    from engine.layers import split_fused

    packed = [("l.attn.qkv_proj.qweight", torch.zeros(1, 16, dtype=torch.int32))]
    with pytest.raises(ValueError, match="qkv_proj.qweight"):
        list(split_fused(packed, {"qkv_proj": [("q_proj", 8), ("k_proj", 4), ("v_proj", 4)]}))
