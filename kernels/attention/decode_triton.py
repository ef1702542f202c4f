"""Sink-aware split-KV decode over the paged cache (bf16, or fp8 read up to bf16), in Triton (one new token
per sequence).

One program attends one (sequence, kv head, split): the GROUP query heads that share the kv head are
the rows of one tensor-core tile (GQA 64/8 -> 8 rows, padded to 16), so every K/V byte is read once
for all of them. Each split streams its slice of the sequence's pages with an online softmax in
base 2. The sink joins the softmax exactly once: split 0 starts its running max at the sink logit
and its denominator at 1 (= exp(sink - sink)); the other splits start empty (max -inf, sum 0). The
merge is then a plain log-sum-exp combine, and a single split writes the output directly.

Sliding layers (window W) see the last min(W, kv_len) tokens of their table; full layers all of it.
Everything the kernels read lives in device tensors and the grid depends only on (batch, splits),
so the launches can be captured in a CUDA graph and replayed with new lengths and page tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.attention.paged_softmax_triton import paged_softmax_step
from kernels.pdl import pdl_prologue

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the split kernel (default_decode_config picks one per layer kind)."""

    block_n: int = 128  # tokens per tile
    num_warps: int = 4
    num_stages: int = 2


def default_decode_config(num_splits: int, window: int | None) -> DecodeConfig:
    """Measured on the H200, 2026-11-29 (kernels/attention/NOTES.md, bench/results/attention_h200.json,
    CUDA-graph sweep): for full layers 128-token tiles in 2 stages were best or within 2% of best at
    every shape swept (batch 1/8/64/256, 8k-32k, 1 to 64 splits); 3 stages lost up to 15% with
    64-token tiles and 8 warps up to 20%. Sliding layers read 128 keys and keep the shape the benchmark
    timed for them (5-26 us from batch 1 to 256)."""
    return DecodeConfig(64, 4, 3) if window else DecodeConfig(128, 4, 2)


# stride_bt (a step's block-table width) is not specialized on: why, at sliding_prefill_triton.py's kernel
@triton.jit(do_not_specialize=["stride_bt"])
def _sink_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, kv_lens_ptr, sinks_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    stride_qt, stride_qh,  # q [B, Hq, D], unit stride in D
    stride_kb, stride_kt, stride_kh,  # cache [num_blocks, PAGE, Hkv, D]; K and V share strides
    stride_bt,  # block_tables [B, max_blocks]
    stride_ot, stride_oh,  # out [B, Hq, D]
    scale_log2,  # softmax scale * log2(e)
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, WINDOW: tl.constexpr,  # WINDOW 0: full causal
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_prologue(PDL)
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    kv_len = tl.load(kv_lens_ptr + seq)
    start = 0
    if WINDOW > 0:
        start = tl.maximum(kv_len - WINDOW, 0)
    # Splits are whole tiles, so only the last tile of a split needs masking work.
    per_split = tl.cdiv(tl.cdiv(kv_len - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, kv_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0) * 1.4426950408889634
    first = split == 0
    m_i = tl.where(first, sink, float("-inf"))
    l_i = tl.where(first, 1.0, 0.0) + tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_kh
    for n0 in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = paged_softmax_step(q, k_ptr, v_ptr, table, head_off, n0, hi, m_i, m_i, l_i, acc, scale_log2,
                                           stride_kb, stride_kt, offs_d, PAGE, BLOCK_N, 0, False)

    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # An empty split (short sequence) leaves sum 0: store o = 0 and lse = -inf so it weighs nothing.
        has = l_i > 0
        safe_l = tl.where(has, l_i, 1.0)
        lse = tl.where(has, m_i + tl.log2(safe_l), float("-inf"))
        part = (seq.to(tl.int64) * num_q_heads + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc / safe_l[:, None],
                 mask=row_ok[:, None])
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    head = tl.program_id(0)
    seq = tl.program_id(1)
    row = seq.to(tl.int64) * tl.num_programs(0) + head
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_s)
    m = tl.max(lse, 0)  # finite: split 0 always holds the sink
    w = tl.exp2(lse - m)
    o = tl.load(part_o_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :])
    merged = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             merged.to(out_ptr.dtype.element_ty))


def split_scratch(max_batch: int, num_q_heads: int, max_splits: int, head_dim: int,
                  device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-size partial outputs and log-sum-exps for up to `max_splits` splits (reused each step)."""
    part_o = torch.empty(max_batch * num_q_heads * max_splits * head_dim, dtype=torch.float32, device=device)
    part_lse = torch.empty(max_batch * num_q_heads * max_splits, dtype=torch.float32, device=device)
    return part_o, part_lse


def sink_decode(
    q: torch.Tensor,  # [B, Hq, D] bf16, one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, page, Hkv, D] bf16, this step's K already written
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [>=B, max_blocks]
    kv_lens: torch.Tensor,  # int32 [>=B]
    sinks: torch.Tensor,  # fp32 [Hq]
    scale: float,
    window: int | None,
    num_splits: int,
    out: torch.Tensor,  # [B, Hq, D]
    part_o: torch.Tensor | None = None,  # from split_scratch, needed when num_splits > 1
    part_lse: torch.Tensor | None = None,
    config: DecodeConfig | None = None,  # None: default_decode_config(num_splits, window)
) -> torch.Tensor:
    batch, num_q_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if q.stride(-1) != 1 or out.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("sink_decode needs unit stride in head_dim and K/V caches of identical layout")
    if num_splits > 1:
        need = batch * num_q_heads * num_splits
        if part_o is None or part_lse is None or part_lse.numel() < need or part_o.numel() < need * head_dim:
            raise ValueError(f"num_splits={num_splits} needs split scratch for {need} rows (see split_scratch)")
    else:
        part_o = part_lse = out  # unused by the single-split specialisation
    config = config or default_decode_config(num_splits, window)
    _sink_decode_split_kernel[(num_splits, num_kv_heads, batch)](
        q, k_cache, v_cache, block_tables, kv_lens, sinks,
        out, part_o, part_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale * LOG2E,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page,
        BLOCK_N=config.block_n, NUM_SPLITS=num_splits, WINDOW=window or 0,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch(q),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_q_heads, batch)](
            part_o, part_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, num_warps=1, **pdl.launch(q),
        )
    return out
