"""Writing real GGUF files (tests, benchmarks): a ``transformers`` Llama with llama.cpp's Q/K row
permutation and the default model's tokenizer metadata, its 2-D tensors optionally quantized.
``gguf`` quantizes Q4_0…Q8_0; the K-quants (which it only reads) are quantized here by the
simple min/max rule, then packed in ggml's byte layout."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (interleaved rope layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)[..., None].view(np.uint8)


def _k_affine(w: np.ndarray, levels: int):
    """Super-blocks of 8 × 32: 6-bit scales and mins under fp16 d/dmin -> (d, dmin, sc, mn, q)."""
    sub = w.reshape(w.shape[0], -1, 8, 32)
    low, high = np.minimum(sub.min(-1), 0), sub.max(-1)
    scale_f, min_f = (high - low) / levels, -low
    d = np.maximum(scale_f.max(-1), 1e-8) / 63
    dmin = np.maximum(min_f.max(-1), 1e-8) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale_f / d[..., None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(min_f / dmin[..., None]), 0, 63).astype(np.uint8)
    step, offset = d[..., None] * sc, dmin[..., None] * mn
    q = np.clip(np.round((sub + offset[..., None]) / step[..., None]), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q.reshape(*q.shape[:2], 256)


def _pack_k_scales(sc, mn):
    out = np.empty((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    return out


def _pack_k_nibbles(q):
    chunks = (q & 15).reshape(*q.shape[:-1], 4, 2, 32)
    return (chunks[..., 0, :] | (chunks[..., 1, :] << 4)).reshape(*q.shape[:-1], 128)


def quantize_q4_k(w):
    d, dmin, sc, mn, q = _k_affine(w, 15)
    blocks = np.concatenate([_f16(d), _f16(dmin), _pack_k_scales(sc, mn), _pack_k_nibbles(q)], -1)
    return blocks.reshape(w.shape[0], -1)


def quantize_q5_k(w):
    d, dmin, sc, mn, q = _k_affine(w, 31)
    high = (q >> 4).reshape(*q.shape[:-1], 8, 32)  # bit j of byte l: high bit of element 32·j + l
    qh = sum((high[..., j, :] << j) for j in range(8)).astype(np.uint8)
    blocks = np.concatenate([_f16(d), _f16(dmin), _pack_k_scales(sc, mn), qh, _pack_k_nibbles(q)], -1)
    return blocks.reshape(w.shape[0], -1)


def quantize_q6_k(w):
    sub = w.reshape(w.shape[0], -1, 16, 16)
    scale_f = np.maximum(np.abs(sub).max(-1), 1e-8) / 31
    d = (scale_f.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale_f / d[..., None]), 1, 127).astype(np.int8)
    step = d[..., None] * sc
    q = (np.clip(np.round(sub / step[..., None]), -32, 31) + 32).astype(np.uint8).reshape(*d.shape, 256)
    ql, qh = [], []
    for half in range(2):
        part = q[..., 128 * half : 128 * half + 128].reshape(*d.shape, 4, 32)
        ql += [
            (part[..., 0, :] & 15) | ((part[..., 2, :] & 15) << 4),
            (part[..., 1, :] & 15) | ((part[..., 3, :] & 15) << 4),
        ]
        qh.append(sum(((part[..., i, :] >> 4) & 3) << (2 * i) for i in range(4)).astype(np.uint8))
    blocks = np.concatenate(ql + qh + [sc.view(np.uint8), _f16(d)], -1)
    return blocks.reshape(w.shape[0], -1)


K_QUANTIZERS = {T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k, T.Q6_K: quantize_q6_k}


def quantize(w: np.ndarray, qtype: T) -> np.ndarray:
    w = np.ascontiguousarray(w, dtype=np.float32)
    return K_QUANTIZERS[qtype](w) if qtype in K_QUANTIZERS else gguf.quants.quantize(w, qtype)


def write_gguf(path: str, model, tokenizer_source, qtype: T | None = None, float_tensors=()) -> None:
    """``tokenizer_source``: a GGUF file's path, or its parsed ``gguf.GGUFReader`` (parsing a
    large vocabulary takes seconds: writers of several files parse it once). Without one the
    file has no tokenizer (prompts are token ids). ``float_tensors``: Hugging Face names of 2-D
    tensors kept in float32 (e.g. the vocabulary table, as AWQ/GPTQ checkpoints keep it)."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    if isinstance(tokenizer_source, str):
        tokenizer_source = gguf.GGUFReader(tokenizer_source)
    fields = tokenizer_source.fields if tokenizer_source else {}
    for key, field in fields.items():
        if key.startswith("tokenizer."):
            value = field.contents()
            if isinstance(value, list):
                writer.add_array(key, value)
            elif isinstance(value, str):
                writer.add_string(key, value)
            elif isinstance(value, bool):
                writer.add_bool(key, value)
            else:
                writer.add_uint32(key, int(value))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.float().numpy().copy()
        if base.endswith("q_proj"):
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        elif base.endswith("k_proj"):
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        name = f"{names.get_name(base)}.{suffix}"
        if qtype is not None and data.ndim == 2 and hf_name not in float_tensors:
            writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
