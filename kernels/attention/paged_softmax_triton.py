"""One step of the online softmax over a tile of keys read through a page table: the part the split decode
kernel (decode_triton.py) and the sliding-window prefill kernel (sliding_prefill_triton.py) share.

Rows are query heads (x queries); the running max `m_i` and sum `l_i` are in base 2 (scores times
scale * log2(e)). Keys [n0, n0 + BLOCK_N) below `hi` are loaded from a cache [num_blocks, PAGE, Hkv, D]
(bf16, or fp8 read up to q's dtype); each row sees all of them, or with PER_ROW_MASK only those in its
window: key j is seen by a row at position p when p - WINDOW < j <= p. With KV_ROWS the keys are instead
rows of the step's own k / v tensors [T, Hkv, D] (key j at row row0 + j; K and V may have different strides),
for prompts whose keys are all in the step: no page-table read before each tile's loads, and bf16 operands
even when the cache is fp8. Inlined into the callers' loops by Triton, so their software pipelining sees the
loads as before.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_tile_rows(table, head_off, n0, hi, stride_kb, stride_kt, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(key indices, in range, row offsets into the cache) of the tile of keys [n0, n0 + BLOCK_N) below hi."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    page = tl.load(table + offs_n // PAGE, mask=n_ok, other=0)
    return offs_n, n_ok, page.to(tl.int64) * stride_kb + (offs_n % PAGE) * stride_kt + head_off


@triton.jit
def softmax_tile(q, k_ptr, v_ptr, offs_n, n_ok, rows, v_rows, q_pos, m_i, l_i, acc, scale_log2, offs_d,
                 WINDOW: tl.constexpr, PER_ROW_MASK: tl.constexpr):
    """The online-softmax update over one tile of keys whose K / V rows are at `rows` / `v_rows`."""
    k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k)) * scale_log2
    if PER_ROW_MASK:
        seen = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - WINDOW) & n_ok[None, :]
    else:
        seen = n_ok[None, :]
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def paged_softmax_step(q, k_ptr, v_ptr, table, head_off, n0, hi, q_pos, m_i, l_i, acc, scale_log2,
                       stride_kb, stride_kt, offs_d,
                       PAGE: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, PER_ROW_MASK: tl.constexpr,
                       KV_ROWS: tl.constexpr = False, row0=0, stride_vt=0, v_head_off=0):
    if KV_ROWS:  # key j is row row0 + j of k (stride_kt, head_off) and of v (stride_vt, v_head_off)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        tok = (row0 + offs_n).to(tl.int64)
        rows = tok * stride_kt + head_off
        v_rows = tok * stride_vt + v_head_off
    else:
        offs_n, n_ok, rows = paged_tile_rows(table, head_off, n0, hi, stride_kb, stride_kt, PAGE, BLOCK_N)
        v_rows = rows
    return softmax_tile(q, k_ptr, v_ptr, offs_n, n_ok, rows, v_rows, q_pos, m_i, l_i, acc, scale_log2, offs_d,
                        WINDOW, PER_ROW_MASK)
