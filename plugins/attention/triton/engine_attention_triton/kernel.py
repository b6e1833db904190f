"""The paged attention kernel: one program per (query tile, KV head).

A tile is up to ``rows`` consecutive query rows of one request; the program holds those rows
for every query head of its KV head as one [rows · group, head_dim] block (grouped-query
heads folded into the rows, so each K/V block is read once per KV head, not per query head)
and walks the request's paged blocks through its block table with an online softmax in
float32. The key range is bounded per tile on the device (from ``seq_lens`` and
``query_start_loc``), so a captured CUDA graph replays correctly over new contents of the
same tensors. ``F32_DOT``: both matmuls in float32 without TF32 (a float32 cache; and under
the interpreter, whose ``tl.dot`` misreads 16-bit floats, on 16-bit values widened exactly,
the probabilities rounded as a 16-bit dot takes them). Masked keys get probability exactly 0
and are loaded as 0, so a window's null block may hold anything.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated: set it before this module is
first imported to run the kernel on CPU tensors (the tests do, in a child process).
"""

from __future__ import annotations

import triton
import triton.language as tl

# the masked-score value: finite, so a row with no key seen yet never computes inf - inf (a
# constexpr: compiled kernels may read no other module globals)
_MASKED = tl.constexpr(-1.0e30)


@triton.jit
def _tanh(x):
    """tanh through exp (no libdevice under the interpreter): 1 - 2 / (e^{2x} + 1), exact at ±inf."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def paged_attention_kernel(
    out_ptr,
    q_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    tile_request_ptr,
    tile_row_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv,
    stride_block,
    stride_slot,
    stride_head,
    stride_table,
    scale,
    softcap,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    request = tl.load(tile_request_ptr + tile)
    first_row = tl.load(tile_row_ptr + tile)
    query_start = tl.load(query_start_ptr + request)
    query_len = tl.load(query_start_ptr + request + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + request)
    context = seq_len - query_len  # the position of the request's first query row

    lanes = tl.arange(0, ROWS * GROUP_PAD)
    row = first_row + lanes // GROUP_PAD
    head = kv_head * GROUP + lanes % GROUP_PAD
    valid_row = (row < query_len) & (lanes % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_PAD)
    valid_dim = dims < HEAD_DIM
    token = (query_start + row).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=valid_row[:, None] & valid_dim[None, :],
        other=0.0,
    )
    query_pos = context + row

    key_end = seq_len
    if CAUSAL:
        key_end = context + tl.minimum(first_row + ROWS, query_len)
    key_start = 0
    if WINDOW:
        key_start = tl.maximum(0, context + first_row - window + 1)

    m_i = tl.full([ROWS * GROUP_PAD], _MASKED, tl.float32)
    l_i = tl.zeros([ROWS * GROUP_PAD], tl.float32)
    acc = tl.zeros([ROWS * GROUP_PAD, HEAD_PAD], tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    for block in range(key_start // BLOCK_SIZE, (key_end + BLOCK_SIZE - 1) // BLOCK_SIZE):
        physical = tl.load(block_table_ptr + request * stride_table + block).to(tl.int64)
        key_pos = block * BLOCK_SIZE + slots
        valid_key = (key_pos < key_end) & (key_pos >= key_start)
        where = (
            cache_ptr
            + physical * stride_block
            + slots[:, None] * stride_slot
            + kv_head * stride_head
            + dims[None, :]
        )
        kv_mask = valid_key[:, None] & valid_dim[None, :]
        k = tl.load(where, mask=kv_mask, other=0.0)
        v = tl.load(where + stride_kv, mask=kv_mask, other=0.0)
        if F32_DOT:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        if SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        allowed = valid_row[:, None] & valid_key[None, :]
        if CAUSAL:
            allowed = allowed & (key_pos[None, :] <= query_pos[:, None])
        if WINDOW:
            allowed = allowed & (key_pos[None, :] > query_pos[:, None] - window)
        scores = tl.where(allowed, scores, _MASKED)
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.where(allowed, tl.exp(scores - m_new[:, None]), 0.0)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if F32_DOT:  # p rounded as the 16-bit dot would take it
            acc = acc * alpha[:, None] + tl.dot(
                p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee"
            )
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=valid_row[:, None] & valid_dim[None, :],
    )
