"""How large the KV cache is and how it is laid out: layers grouped by how they attend (full,
sliding window, per-request state), each group's blocks sized in the memory budget, the bytes a
token or a block takes in each backend's layout and cache dtype, and the zeroed pages."""

from __future__ import annotations

import math

import torch

from engine.interfaces import KVCacheGroup
from engine.runner.layer_attention import LayerAttention, StateSlots


def kv_group_of_layers(layout) -> tuple[tuple[int | None, ...], tuple[int, ...]]:
    """(each KV cache group's sliding window, each layer's group): layers grouped by their
    sliding window, full-attention layers first; layers keeping per-request state
    (``AttentionKind.state``) last, in a group of their own (its window None)."""
    keys = [
        (layout.kind(i).state is not None, layout.kind(i).sliding_window) for i in range(layout.num_layers)
    ]
    distinct = sorted(set(keys), key=lambda k: (k[0], k[1] is not None, k[1] or 0))
    return tuple(window for _, window in distinct), tuple(distinct.index(k) for k in keys)


def kv_cache_groups(
    config, layers: LayerAttention, windows: tuple[int | None, ...], platform, reserved_bytes: int = 0
) -> tuple[KVCacheGroup, ...]:
    """Each group's layers and blocks. Beside a full-attention group, a sliding-window group
    gets only what ``max_num_seqs`` requests can hold at once (``_window_blocks``); the rest of
    the budget (or ``num_blocks``, which counts a full group's blocks) goes to the others. A
    state group (Mamba2 layers' per-request state) gets at most a slot per sequence beside its
    null slot: its state bytes are accounted in the same budget as the pages.
    ``reserved_bytes`` (CUDA graphs) come out of a budget taken from the device's memory."""
    members = [
        tuple(i for i, g in enumerate(layers.layer_group) if g == group) for group in range(len(windows))
    ]
    per_block = [sum(layer_block_bytes(layers, i) for i in m) for m in members]
    states = [isinstance(layers.backends[layers.layer_backend[m[0]]], StateSlots) for m in members]
    full = any(w is None and not state for w, state in zip(windows, states))
    caps = [_group_cap(config, w, full, state) for w, state in zip(windows, states)]
    if config.cache.num_blocks is not None:
        blocks = config.cache.num_blocks
    else:
        budget = _kv_cache_budget(config.cache, platform)
        if not config.cache.kv_cache_memory:
            budget -= reserved_bytes
        even = budget // sum(per_block)
        capped = [c is not None and c < even for c in caps]
        rest = budget - sum(c * b for c, b, k in zip(caps, per_block, capped) if k)
        blocks = rest // (sum(b for b, k in zip(per_block, capped) if not k) or 1)
        if blocks < 2:
            raise ValueError(
                f"kv_cache_memory: the KV cache budget holds fewer than 2 blocks of {sum(per_block)} bytes"
            )
    groups = tuple(
        KVCacheGroup(m, blocks if c is None else min(blocks, c), w, state)
        for m, c, w, state in zip(members, caps, windows, states)
    )
    _check_fits(sum(g.num_blocks * b for g, b in zip(groups, per_block)), platform)
    return groups


def _group_cap(config, window: int | None, beside_full: bool, state: bool) -> int | None:
    """The most blocks a group can use (None: no bound but the budget); ``beside_full``: the
    model has a full-attention group, which the budget's rest goes to."""
    if state:
        return config.scheduler.max_num_seqs + 1  # one slot per running request, and the null slot
    return _window_blocks(config, window) if window is not None and beside_full else None


def _window_blocks(config, window: int) -> int:
    """The most blocks a sliding-window group's requests hold at once: each keeps its window's
    blocks and those of one step's tokens (a prefill chunk and draft lookahead), plus the watermark."""
    bs = config.cache.block_size
    lookahead = int((config.speculative_config or {}).get("num_speculative_tokens", 0))
    per_request = -(-(window - 1 + config.scheduler.max_num_batched_tokens + lookahead) // bs) + 1
    return int(-(-config.scheduler.max_num_seqs * per_request // (1 - config.cache.watermark))) + 1


def _kv_cache_budget(cache_config, platform) -> int:
    """Bytes for the KV cache: the size given, else the share of the device the instance may
    use less what it holds now (the loaded model), else a share of the free memory."""
    if cache_config.kv_cache_memory:
        return cache_config.kv_cache_memory
    if cache_config.memory_utilization is not None:
        used, total = platform.memory_in_use()
        budget = int(cache_config.memory_utilization * total) - used
        if budget <= 0:
            raise ValueError(
                f"memory_utilization: {cache_config.memory_utilization} of {total} bytes leaves "
                f"nothing for the KV cache beside the {used} bytes in use"
            )
        return budget
    return int(platform.free_memory() * cache_config.kv_cache_memory_fraction)


def _check_fits(kv_bytes: int, platform) -> None:
    """Refuse a KV cache larger than the device's memory beside what this process holds: it
    could never be allocated (on the CPU the kernel would kill the engine after swapping)."""
    try:
        used, total = platform.memory_in_use()
    except NotImplementedError:
        return
    if kv_bytes > total - used:
        raise ValueError(
            f"kv_cache_memory: a KV cache of {kv_bytes / 2**30:.1f} GiB does not fit in the "
            f"{(total - used) / 2**30:.1f} GiB of {platform.name} memory beside the {used / 2**30:.1f} GiB "
            "this process holds; lower --kv-cache-memory-bytes, --gpu-memory-utilization or "
            "--num-gpu-blocks-override"
        )


def kv_capacity(groups, block_size: int, max_model_len: int) -> int:
    """Tokens the paged groups hold (the first one's blocks but the null one); a model of state
    layers only holds any length in a slot: ``max_model_len`` per slot."""
    paged = [g for g in groups if not g.state]
    if not paged:
        return (groups[0].num_blocks - 1) * max_model_len
    return (paged[0].num_blocks - 1) * block_size


def kv_bytes_per_token(layers: LayerAttention, block_size: int) -> int:
    """KV cache bytes one token takes over all paged layers, each in its backend's layout
    (per-head K/V, a paged latent vector ...) and cache dtype: what the pool is sized by. State
    layers take :func:`state_bytes_per_request` whatever the length."""
    paged = [i for i, b in enumerate(layers.layer_backend) if not isinstance(layers.backends[b], StateSlots)]
    return sum(layer_block_bytes(layers, i) for i in paged) // block_size


def state_bytes_per_request(layers: LayerAttention) -> int:
    """Bytes of per-request state (Mamba2 conv + SSM) over all state layers: one slot each."""
    state = [i for i, b in enumerate(layers.layer_backend) if isinstance(layers.backends[b], StateSlots)]
    return sum(layer_block_bytes(layers, i) for i in state)


def layer_block_bytes(layers: LayerAttention, layer: int) -> int:
    backend = layers.backends[layers.layer_backend[layer]]
    return backend.spec.cache_dtype.itemsize * math.prod(backend.kv_cache_shape(1))


def allocate_kv_caches(layers: LayerAttention, groups, platform) -> list[torch.Tensor]:
    """One zeroed KV cache per layer (``platform.allocate_zeroed``), sized for its group's blocks,
    in its backend's cache dtype (the activation dtype, or the quantized one --kv-cache-dtype asks)."""
    out = []
    for b, g in zip(layers.layer_backend, layers.layer_group):
        backend = layers.backends[b]
        shape = backend.kv_cache_shape(groups[g].num_blocks)
        out.append(platform.allocate_zeroed(tuple(shape), backend.spec.cache_dtype))
    return out
