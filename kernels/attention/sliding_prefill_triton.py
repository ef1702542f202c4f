"""Sink attention of the sliding-window layers over the paged cache, for prompt chunks (Triton).

A sliding layer's query sees itself and the W - 1 keys before it (W = 128), so a tile of BLOCK_M
consecutive queries needs only BLOCK_M + W - 1 keys. FlashInfer's sink prefill with window_left spent
~155 us per 20b layer on a 4k prompt (~55 TFLOP/s of useful work, kernels/attention/NOTES.md); the
bytes are q + out (33.5 MB at 4k) plus the window's K/V, ~20 us at the copy ceiling.

One program attends one (tile, kv head): its rows are BLOCK_M queries x the GROUP query heads sharing
the kv head (8 x 16 = 128 rows), so each K/V tile is read once for all of them. Keys come from the
sequence's page table (bf16 pages, or fp8 pages read up to bf16 as the decode kernel does), with an
online softmax in base 2 that starts from the sink (running max = sink logit, sum = 1): no split, no
merge. Tiles never span two sequences: `plan_tiles` lists (sequence, first query) per tile on the host.

Positions follow metadata.py: within the visible KV of length L, query i of n sits at index L - n + i.
The twin is reference.sink_attention; tests/kernels/attention_interpreter_cases.py and
tests/kernels/test_attention_gpu.py compare them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.attention.paged_softmax_triton import paged_softmax_step
from kernels.pdl import pdl_prologue

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class SlidingPrefillConfig:
    """Launch shape. Default: the fastest of the five bench/attention timed on the H200 (2026-11-30,
    bench/results/attention_prefill_h200.json): 78 / 145 / 558 us for one 4k / 8k / 32k prompt against
    FlashInfer's windowed fa3 144 / 274 / 886 us; 16/64 with 4 warps x 2 stages 90 / 167 / 645."""

    block_m: int = 16  # queries per tile (x GROUP heads = the tile's rows)
    block_n: int = 64  # keys per inner step
    num_warps: int = 8
    num_stages: int = 3
    # keys past the last whole block_n step in steps of tail_n (0: one more block_n step). A 16-query tile of a
    # 128 window sees 143 keys: 2 x 64 + 16 computed instead of 3 x 64 (H200 2026-12-03, one 8k prompt: 147.2 ->
    # 134.8 us over bf16 pages, 255.7 -> 144.4 over fp8 pages, 128.5 -> 120.6 over the step's rows;
    # bench/results/attention_sliding_rows_h200.json)
    tail_n: int = 16


def single_query_config(group: int) -> SlidingPrefillConfig:
    """For sequences with one new query (the decode rows of a mixed step): tiles of as few queries as keep
    the tile's rows (queries x padded GROUP) at the 16 a tensor-core dot needs."""
    return SlidingPrefillConfig(block_m=max(1, 16 // triton.next_power_of_2(group)), block_n=64, num_warps=4,
                                num_stages=3)


# the launch shapes bench/attention times (and tests/kernels/test_attention_gpu.py checks)
SWEEP_CONFIGS = [SlidingPrefillConfig(), SlidingPrefillConfig(tail_n=0), SlidingPrefillConfig(16, 64, 4, 3),
                 SlidingPrefillConfig(16, 64, 4, 2, tail_n=0), SlidingPrefillConfig(16, 64, 4, 3, tail_n=0),
                 SlidingPrefillConfig(8, 64, 4, 3), SlidingPrefillConfig(8, 64, 8, 3), SlidingPrefillConfig(16, 64, 8, 4),
                 SlidingPrefillConfig(32, 64, 8, 3), SlidingPrefillConfig(16, 32, 4, 3), SlidingPrefillConfig(4, 64, 4, 3)]


@dataclass
class SlidingTiles:
    """Per-step plan: which sequence and first query each program's tile covers, and per sequence its
    first row in q, its query count, its page table and visible length (device tensors)."""

    tile_seq: torch.Tensor  # int32 [tiles]
    tile_q0: torch.Tensor  # int32 [tiles]
    q_start: torch.Tensor  # int32 [B]
    q_len: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    kv_lens: torch.Tensor  # int32 [B]
    num_tiles: int


def plan_tiles(query_lens: list[int], block_tables: torch.Tensor, kv_lens: torch.Tensor, block_m: int,
               q_starts: list[int] | None = None) -> SlidingTiles:
    """Tiles of `block_m` queries per sequence (built with numpy on the host, one copy). The sequences' queries
    start at rows `q_starts` of q (default: back to back from row 0), so a subset of a step's sequences can be
    planned over the whole step's q and out. Its twin is reference.sliding_tile_lists (a loop over the tiles,
    as this was until 2026-12-01: 2.8-4.6x slower for an 8k prompt or a mixed step's hundreds of one-query
    rows, `python -m bench.plan_tiles_host`)."""
    b = len(query_lens)
    if b == 1:  # one prompt (the time-to-first-token path): plain ints, sequence 0 throughout
        n = int(query_lens[0])
        t = -(-n // block_m)
        starts, lens = (0 if q_starts is None else int(q_starts[0])), n
    else:
        lens = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        per_seq = -(-lens // block_m)  # tiles of each sequence
        t = int(per_seq.sum())
        starts = np.cumsum(lens) - lens if q_starts is None else np.asarray(q_starts, dtype=np.int64).reshape(-1)
    # Each list starts on a 16-byte boundary: Triton specializes pointer arguments on that alignment, so
    # unpadded slices (offsets t, 2t, 2t + b) gave the kernel a new variant to compile whenever a step's
    # tile and sequence counts changed their residues mod 4 (mixed steps of a burst did, mid-run).
    pt, pb = t + -t % 4, b + -b % 4
    flat = np.zeros(2 * pt + 2 * pb, dtype=np.int32)
    if b == 1:
        flat[pt:pt + t] = np.arange(0, t * block_m, block_m)
    elif b:
        flat[:t] = np.repeat(np.arange(b), per_seq)  # sequence of each tile
        flat[pt:pt + t] = (np.arange(t) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)) * block_m  # first query
    flat[2 * pt:2 * pt + b] = starts
    flat[2 * pt + pb:2 * pt + pb + b] = lens
    packed = torch.from_numpy(flat).to(block_tables.device, non_blocking=True)  # one copy
    return SlidingTiles(packed[:t], packed[pt:pt + t], packed[2 * pt:2 * pt + b], packed[2 * pt + pb:2 * pt + pb + b],
                        block_tables, kv_lens, t)


# stride_bt (the step's block-table width) is not specialized on: Triton would compile a variant per
# "divisible by 16 / equal to 1 / other" width, and eager mixed steps, whose tables are as wide as their
# longest sequence, met new ones mid-burst (a ~0.4 s compile inside a step: bench/disaggregated_load.py
# --profile-both, 2026-11-30)
@triton.jit(do_not_specialize=["stride_bt"])
def _sliding_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, sinks_ptr,
    tile_seq_ptr, tile_q0_ptr, q_start_ptr, q_len_ptr, block_tables_ptr, kv_lens_ptr,
    stride_qt, stride_qh,  # q [T, Hq, D], unit stride in D
    stride_kb, stride_kt, stride_kh,  # cache [num_blocks, PAGE, Hkv, D], K and V alike (KV_ROWS: k rows [T, Hkv, D])
    stride_bt,  # block_tables [B, max_blocks]
    stride_ot, stride_oh,  # out [T, Hq, D]
    scale_log2,  # softmax scale * log2(e)
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, PDL: tl.constexpr,
    stride_vt, stride_vh,  # KV_ROWS: v's strides (k's are stride_kt / stride_kh)
    KV_ROWS: tl.constexpr, TAIL_N: tl.constexpr,
):
    pdl_prologue(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    i0 = tl.load(tile_q0_ptr + tile)
    q_start = tl.load(q_start_ptr + seq)
    n_q = tl.load(q_len_ptr + seq)
    kv_len = tl.load(kv_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    qi = i0 + rows // GROUP_PAD  # query index within the sequence
    g = rows % GROUP_PAD
    row_ok = (qi < n_q) & (g < GROUP)
    q_pos = kv_len - n_q + qi  # index among the visible keys
    heads = kv_head * GROUP + g
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + qi).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0) * 1.4426950408889634  # the sink, counted once
    l_i = tl.full([BLOCK_M * GROUP_PAD], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM], tl.float32)

    first = kv_len - n_q + i0
    lo = tl.maximum(first - (WINDOW - 1), 0)
    hi = tl.minimum(first + BLOCK_M, kv_len)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_kh
    row0 = q_start + n_q - kv_len  # KV_ROWS: the row of key 0 (callers guarantee every key seen is a step row)
    v_head_off = kv_head * stride_vh
    if TAIL_N:
        whole_hi = lo + (hi - lo) // BLOCK_N * BLOCK_N
    else:
        whole_hi = hi
    for n0 in range(lo, whole_hi, BLOCK_N):
        m_i, l_i, acc = paged_softmax_step(q, k_ptr, v_ptr, table, head_off, n0, hi, q_pos, m_i, l_i, acc, scale_log2,
                                           stride_kb, stride_kt, offs_d, PAGE, BLOCK_N, WINDOW, True,
                                           KV_ROWS, row0, stride_vt, v_head_off)
    if TAIL_N:
        for n0 in range(whole_hi, hi, TAIL_N):
            m_i, l_i, acc = paged_softmax_step(q, k_ptr, v_ptr, table, head_off, n0, hi, q_pos, m_i, l_i, acc,
                                               scale_log2, stride_kb, stride_kt, offs_d, PAGE, TAIL_N, WINDOW, True,
                                               KV_ROWS, row0, stride_vt, v_head_off)

    o = acc / l_i[:, None]
    out_rows = (q_start + qi).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + out_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def sliding_prefill(
    q: torch.Tensor,  # [T, Hq, D] bf16: the queries of the planned sequences, back to back
    k_cache: torch.Tensor,  # [num_blocks, page, Hkv, D] bf16 or fp8, this step's K already written
    v_cache: torch.Tensor,
    sinks: torch.Tensor,  # fp32 [Hq]
    scale: float,
    window: int,
    tiles: SlidingTiles,
    out: torch.Tensor,  # [T, Hq, D]
    config: SlidingPrefillConfig | None = None,
    kv_rows: bool = False,
) -> torch.Tensor:
    """kv_rows: k_cache / v_cache are instead the step's k / v rows [T, Hkv, D] (v may be a strided view), row
    for row with q; only for tiles whose sequences have no keys before this step's (kv_lens == query counts)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    if kv_rows:
        if k_cache.dim() != 3 or v_cache.shape != k_cache.shape or k_cache.shape[0] != q.shape[0] \
                or v_cache.stride(-1) != 1:
            raise ValueError(f"kv_rows: k / v must be [T, Hkv, D] rows of q's T = {q.shape[0]}, got "
                             f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
        page, num_kv_heads = 1, k_cache.shape[1]
        stride_kb, (stride_kt, stride_kh), (stride_vt, stride_vh) = 0, k_cache.stride()[:2], v_cache.stride()[:2]
    else:
        _, page, num_kv_heads, _ = k_cache.shape
        if k_cache.stride() != v_cache.stride():
            raise ValueError("sliding_prefill needs K/V caches of identical layout")
        stride_kb, stride_kt, stride_kh = k_cache.stride()[:3]
        stride_vt = stride_vh = 0
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not divide into {num_kv_heads} kv heads")
    if q.stride(-1) != 1 or out.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("sliding_prefill needs unit stride in head_dim")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    config = config or SlidingPrefillConfig()
    group = num_q_heads // num_kv_heads
    if tiles.num_tiles:
        _sliding_prefill_kernel[(tiles.num_tiles, num_kv_heads)](
            q, k_cache, v_cache, out, sinks,
            tiles.tile_seq, tiles.tile_q0, tiles.q_start, tiles.q_len, tiles.block_tables, tiles.kv_lens,
            q.stride(0), q.stride(1),
            stride_kb, stride_kt, stride_kh,
            tiles.block_tables.stride(0),
            out.stride(0), out.stride(1),
            scale * LOG2E,
            GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim, PAGE=page,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, WINDOW=window,
            stride_vt=stride_vt, stride_vh=stride_vh, KV_ROWS=kv_rows, TAIL_N=config.tail_n,
            num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch(q),
        )
    return out
