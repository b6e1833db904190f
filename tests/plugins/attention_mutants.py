"""Planted bugs: the torch attention backend with one mistake each, the mistakes attention
backend authors make — most of them pass on whole prompts in fresh caches and show only on a
later chunk, grouped heads, scattered blocks or a spec's attention kind. Not registered by the
suite's conftest: ``tests/test_attention_kit_mutations.py`` registers them in a child pytest that
runs the attention kit on each, and checks that it fails."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from engine import hookimpl
from engine.interfaces import KVScale
from engine_attention_torch.backend import TorchAttentionBackend, _gather_blocks, softcap


def _cached(key_cache, value_cache, group):
    """A prefill group's keys and values [1, Hkv, S, D], as the torch backend gathers them."""
    return (
        cache.index_select(1, group.blocks).flatten(1, 2)[:, : group.seq_len].unsqueeze(0)
        for cache in (key_cache, value_cache)
    )


def _decode_rows(q, keys, values, scale: float, bias, cap: float | None = None):
    """The torch backend's batched decode: q [Hkv, B, g, D] over keys/values [Hkv, B, L, D]."""
    scores = softcap(torch.matmul(q, keys.transpose(-1, -2)).float() * scale, cap) + bias
    return torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)


class TopLeftCausal(TorchAttentionBackend):
    """Attends every causal chunk with SDPA's ``is_causal``, which aligns the mask top-left: a
    later chunk's query i sees keys 0..i, not the cached prefix and the chunk up to itself."""

    def _prefill(self, query, key_cache, value_cache, group, read, sinks):
        s = self.spec
        if not s.causal or s.logit_softcap is not None or s.sliding_window is not None:
            return super()._prefill(query, key_cache, value_cache, group, read, sinks)
        keys, values = read(*_cached(key_cache, value_cache, group))
        queries = query.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, scale=s.scale, enable_gqa=True
        )
        return out[0].transpose(0, 1).reshape(query.shape)


class ModuloHeads(TorchAttentionBackend):
    """Decodes query head h against KV head h % Hkv (K/V expanded with ``repeat``), not h // group
    (``repeat_interleave``): the same wherever every head has its own KV head."""

    def _decode(self, query, key_cache, value_cache, group, read, sinks):
        s = self.spec
        batch, g = query.shape[0], s.num_heads // s.num_kv_heads
        keys, values = read(*(_gather_blocks(cache, group.block_table) for cache in (key_cache, value_cache)))
        q = query.view(batch, g, s.num_kv_heads, s.head_dim).permute(2, 0, 1, 3)  # [Hkv, B, g, D]
        out = _decode_rows(q, keys, values, s.scale, group.bias, s.logit_softcap)
        return out.permute(1, 2, 0, 3).reshape(batch, s.num_heads, s.head_dim)


class ConsecutiveBlocks(TorchAttentionBackend):
    """Reads a lone decode stream's blocks as the run starting at its first one: blocks were
    consecutive in every cache the author tried, fresh ones."""

    def _decode_one(self, query, kv_cache, group, read, sinks):
        first, count = int(group.block_table[0, 0]), group.block_table.shape[1]
        return super()._decode_one(
            query, kv_cache, attrs.evolve(group, blocks=slice(first, first + count)), read, sinks
        )


class WindowByBlocks(TorchAttentionBackend):
    """Decodes under a sliding window from the start of the block the window begins in: the
    blocks before it skipped, the keys before it in that block still attended."""

    def _window_start(self, context):
        return self._first_block(context, 1) * self.spec.block_size


class WindowOneWider(TorchAttentionBackend):
    """Lets a query see ``sliding_window`` keys before its own, one more than the window (the
    ``window_size`` left edge of flash-attn taken as the window)."""

    def __init__(self, spec, platform, registry=None):
        if spec.sliding_window is not None:
            spec = attrs.evolve(spec, sliding_window=spec.sliding_window + 1)
        super().__init__(spec, platform, registry)


class DecodeWithoutSoftcap(TorchAttentionBackend):
    """Soft-caps the logits of prefill chunks and lone streams but not of a batch of decode rows."""

    def _decode(self, query, key_cache, value_cache, group, read, sinks):
        s = self.spec
        batch, g = query.shape[0], s.num_heads // s.num_kv_heads
        keys, values = read(*(_gather_blocks(cache, group.block_table) for cache in (key_cache, value_cache)))
        q = query.view(batch, s.num_kv_heads, g, s.head_dim).transpose(0, 1)
        out = _decode_rows(q, keys, values, s.scale, group.bias)
        return out.transpose(0, 1).reshape(batch, s.num_heads, s.head_dim)


class DefaultScale(TorchAttentionBackend):
    """Calls SDPA on a whole prompt without ``scale=``: its default 1/√head_dim, not the spec's
    query scale (the two are equal unless a model sets one)."""

    def _prefill(self, query, key_cache, value_cache, group, read, sinks):
        s = self.spec
        if not s.causal or s.logit_softcap is not None or group.prefix_len or group.mask is not None:
            return super()._prefill(query, key_cache, value_cache, group, read, sinks)
        keys, values = read(*_cached(key_cache, value_cache, group))
        queries = query.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(query.shape)


class GatherOncePerStep(TorchAttentionBackend):
    """Gathers a decode batch's keys and values once per step, on the first layer, and hands the
    other layers the same ones (the block tables are the same; the caches are not)."""

    def build_metadata(self, layout):
        self._gathered = {}
        return super().build_metadata(layout)

    def _decode(self, query, key_cache, value_cache, group, read, sinks):
        s = self.spec
        batch, g = query.shape[0], s.num_heads // s.num_kv_heads
        if id(group) not in self._gathered:
            caches = (key_cache, value_cache)
            self._gathered[id(group)] = read(*(_gather_blocks(cache, group.block_table) for cache in caches))
        keys, values = self._gathered[id(group)]
        q = query.view(batch, s.num_kv_heads, g, s.head_dim).transpose(0, 1)
        out = _decode_rows(q, keys, values, s.scale, group.bias, s.logit_softcap)
        return out.transpose(0, 1).reshape(batch, s.num_heads, s.head_dim)


class AlwaysCausal(TorchAttentionBackend):
    """Takes ``causal`` for granted: a bidirectional spec is accepted and attended causally."""

    def __init__(self, spec, platform, registry=None):
        super().__init__(attrs.evolve(spec, causal=True), platform, registry)


class IgnoresKVScale(TorchAttentionBackend):
    """Stores fp8 K/V divided by the layer's scales but reads them back unscaled: right while
    every scale is 1.0, as in a checkpoint without KV scales."""

    def forward(self, query, key, value, kv_cache, metadata, kv_scale=None):
        read = self._write(key, value, kv_cache, metadata.slot_mapping, kv_scale)
        if read.scale is not None:
            read = attrs.evolve(read, scale=KVScale())
        out = torch.empty_like(query)
        for group in metadata.groups:
            out[group.rows] = self._attend(query[group.rows], kv_cache, group, read)
        return out


class ClaimsChunkInvariance(TorchAttentionBackend):
    """Declares ``chunk_invariant`` though a prompt's row is summed in another order by the call
    it comes in: a whole prompt through the causal flash kernel, a later chunk through one masked
    call, a decode row through batched matmuls (matching the reference every time)."""

    chunk_invariant = True


class DecodeWithoutSinks(TorchAttentionBackend):
    """Drops the sink logits in batched decode (the prefill path, written first, has them)."""

    def _decode(self, query, key_cache, value_cache, group, read, sinks):
        return super()._decode(query, key_cache, value_cache, group, read, None)


MUTANTS = {
    "top-left-causal": TopLeftCausal,
    "modulo-heads": ModuloHeads,
    "consecutive-blocks": ConsecutiveBlocks,
    "window-by-blocks": WindowByBlocks,
    "window-one-wider": WindowOneWider,
    "decode-without-softcap": DecodeWithoutSoftcap,
    "default-scale": DefaultScale,
    "gather-once-per-step": GatherOncePerStep,
    "always-causal": AlwaysCausal,
    "claims-chunk-invariance": ClaimsChunkInvariance,
    "ignores-kv-scale": IgnoresKVScale,
    "decode-without-sinks": DecodeWithoutSinks,
}
# the interface version each mutant registers for (default 4): sinks are handed only from v6 on
API = {"decode-without-sinks": 6}


@hookimpl
def register_attention_backends(register):
    for name, backend in MUTANTS.items():
        register(name, backend, api=API.get(name, 4))
