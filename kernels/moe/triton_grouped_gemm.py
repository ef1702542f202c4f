"""FP8 block-scaled grouped GEMM in Triton: the fallback where DeepGEMM is absent, and its yardstick.

D[rows of expert e] = A[rows] @ W[e]^T with A in 1x128 scaled FP8 rows (`Fp8Rows`) and W[e] in
128x128-block scaled FP8 [N, Kp]. Same two layouts as DeepGEMM:
- contiguous: rows sorted by expert, segments 128-aligned, `m_indices` names the expert of each row
  (-1: padding); a tile's expert is its first row's, so BLOCK_M must divide the 128 alignment;
- masked: A is [E, m_cap, Kp] and only the first counts[e] rows of expert e are computed.

Each 128-deep K step is one FP8 tensor-core dot in fp32, then scaled by the row scales of A times
the block scale of W (BLOCK_N <= 128 keeps one weight scale per tile). Twin: fp8_reference.grouped_gemm.

Decode (`grouped_gemm_decode`, masked layout, T <= 64 tokens): streaming the active experts' weights
is the whole cost, so programs tile only N, one program row per *active* expert (the plan lists them),
and the dot is swapped (W tile [BLOCK_N, 128] times A^T [128, BLOCK_T]) so the weights fill the
tensor-core M side and the few tokens the narrow N side. At T=1 the general kernel ran 45 column
tiles x 4 experts of 64x128 (~1.1 TB/s, kernels/moe/NOTES.md); here it is N/BLOCK_N x 4 programs.

Segments (`grouped_gemm_segments`, contiguous layout, a few to ~100 rows per expert): the decode kernel's
swapped dot over each expert's segment of the contiguous layout, one program per (column tile, expert), so
each weight tile is read once per BLOCK_T rows of its expert instead of once per 128-row tile of padding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.moe.epilogues_triton import Fp8Rows
from kernels.moe.fp8_quant import BLOCK
from kernels.pdl import pdl_prologue


@triton.jit
def _fp8_grouped_gemm_kernel(a_ptr, sfa_ptr, b_ptr, sfb_ptr, d_ptr, layout_ptr,
                             rows_per_group, n, stride_a, stride_bg, stride_bn, stride_d,
                             sfa_group_stride, sfa_k_stride, sfb_group_stride, sfb_n_stride,
                             MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             GROUP_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_KB: tl.constexpr):
    pid = tl.program_id(0)
    group = tl.program_id(1)
    num_pid_m = (rows_per_group + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (n + BLOCK_N - 1) // BLOCK_N
    # Walk GROUP_M row blocks across all column blocks before moving on: the expert's weight tiles
    # stay in L2 while its row blocks pass over them.
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    if MASKED:
        expert = group
        valid = pid_m * BLOCK_M < tl.load(layout_ptr + expert)
    else:
        expert = tl.load(layout_ptr + pid_m * BLOCK_M)
        valid = expert >= 0
    if valid:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < rows_per_group
        n_ok = offs_n < n
        rows = group.to(tl.int64) * rows_per_group + offs_m
        a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
        b_ptrs = b_ptr + expert.to(tl.int64) * stride_bg + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :]
        sfa_ptrs = sfa_ptr + group.to(tl.int64) * sfa_group_stride + offs_m
        sfb_ptrs = sfb_ptr + expert.to(tl.int64) * sfb_group_stride + (pid_n * BLOCK_N // BLOCK_K) * sfb_n_stride
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(NUM_KB):
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[:, None], other=0.0)
            sa = tl.load(sfa_ptrs + kb * sfa_k_stride, mask=m_ok, other=0.0)
            sb = tl.load(sfb_ptrs + kb)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        d_ptrs = d_ptr + rows[:, None] * stride_d + offs_n[None, :]
        tl.store(d_ptrs, acc.to(d_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _config(masked: bool, expected_m: int) -> dict:
    # Decode (masked, a few rows per expert) streams weights: 64-row tiles, more CTAs in flight.
    # 128x128 tiles, 8 warps, 4-5 stages measured best for prefill (bench/moe.py gemm section,
    # H200 2026-11-29: 567-574 TFLOP/s; 4 warps: 206).
    if masked and expected_m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=1, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4)


def grouped_gemm(a: Fp8Rows, w: torch.Tensor, w_scales: torch.Tensor, out: torch.Tensor,
                 layout: torch.Tensor, masked: bool, config: dict | None = None,
                 expected_m: int | None = None) -> torch.Tensor:
    """out [rows, N] (bf16) = A @ W[e]^T per expert. `layout`: m_indices [rows] (contiguous) or
    counts [E] (masked, A grouped [E, m_cap, Kp]); `expected_m`: typical rows per expert (tiling hint)."""
    e, n, kp = w.shape
    if a.data.shape[1] != kp or w_scales.shape != (e, -(-n // BLOCK), kp // BLOCK):
        raise ValueError(f"A is [*, {a.data.shape[1]}], W {tuple(w.shape)} with scales {tuple(w_scales.shape)}: "
                         f"K must match and W's scales must be [E, ceil(N/128), K/128]")
    cfg = dict(_config(masked, a.rows_per_group if expected_m is None else expected_m), **(config or {}))
    if BLOCK % cfg["BLOCK_M"] or BLOCK % cfg["BLOCK_N"]:
        raise ValueError("BLOCK_M and BLOCK_N must divide 128 (row-segment alignment, weight-scale blocks)")
    groups = a.groups if masked else 1
    grid = (triton.cdiv(a.rows_per_group, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), groups)
    _fp8_grouped_gemm_kernel[grid](
        a.data, a.scale_storage, w, w_scales, out, layout,
        a.rows_per_group, n, a.data.stride(0), w.stride(0), w.stride(1), out.stride(0),
        a.sf_group_stride, a.sf_k_stride, w_scales.stride(0), w_scales.stride(1),
        MASKED=masked, BLOCK_K=BLOCK, NUM_KB=kp // BLOCK, **cfg)
    return out


@triton.jit
def _scaled_k_loop(acc, a_ptrs, b_ptrs, sfa_ptrs, sfb_ptrs, t_ok, n_ok, kb_start, kb_end, k_valid, sfa_k_stride,
                   BLOCK_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_T] plus the K blocks kb_start..kb_end-1 of B [BLOCK_N, K] (b_ptrs: block kb_start) times
    A^T [K, BLOCK_T] (a_ptrs), each block's product scaled by its weight block's and its rows' scales: the swapped dot
    of the decode and segments kernels (weights on the MMA's M side). K padding (zeros) at or past k_valid is not read."""
    for kb in range(kb_start, kb_end):
        k_ok = tl.arange(0, BLOCK_K) < k_valid - kb * BLOCK_K
        b = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=t_ok[None, :] & k_ok[:, None], other=0.0)
        sa = tl.load(sfa_ptrs + kb * sfa_k_stride, mask=t_ok, other=0.0)
        sb = tl.load(sfb_ptrs + kb)
        acc += tl.dot(b, a) * (sb * sa[None, :])
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _fp8_grouped_gemm_decode_kernel(a_ptr, sfa_ptr, b_ptr, sfb_ptr, d_ptr, counts_ptr, active_ptr, num_active_ptr,
                                    a_row_map_ptr, rows_per_group, n, k_valid, stride_a, stride_bg, stride_bn, stride_d,
                                    stride_split, sfa_group_stride, sfa_k_stride, sfb_group_stride, sfb_n_stride,
                                    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                    NUM_KB: tl.constexpr, SPLIT_K: tl.constexpr, A_ROW_MAP: tl.constexpr,
                                    PDL: tl.constexpr, EARLY_ROUTING: tl.constexpr = False):
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    split = tl.program_id(2)
    # EARLY_ROUTING (the down GEMM): the plan comes from the front, three launches back and so complete under PDL
    # (kernels/pdl.py): read before the wait. The gate_up GEMM's predecessor is the front itself: after it.
    if EARLY_ROUTING:
        n_active = tl.load(num_active_ptr)
        expert = tl.where(slot < n_active, tl.load(active_ptr + slot), 0)  # slots past n_active hold stale ids
        count = tl.load(counts_ptr + expert)
    pdl_prologue(PDL)
    if not EARLY_ROUTING:
        n_active = tl.load(num_active_ptr)
    if slot < n_active:
        if not EARLY_ROUTING:
            expert = tl.load(active_ptr + slot)
            count = tl.load(counts_ptr + expert)
        kb_per_split: tl.constexpr = (NUM_KB + SPLIT_K - 1) // SPLIT_K
        kb0 = split * kb_per_split
        offs_t = tl.arange(0, BLOCK_T)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = kb0 * BLOCK_K + tl.arange(0, BLOCK_K)
        t_ok = offs_t < count
        n_ok = offs_n < n
        rows = expert.to(tl.int64) * rows_per_group + offs_t
        if A_ROW_MAP:  # A holds token rows (one group): row r of the layout reads A row a_row_map[r]
            a_rows = tl.load(a_row_map_ptr + rows, mask=t_ok, other=0).to(tl.int64)
            sfa_ptrs = sfa_ptr + a_rows
        else:
            a_rows = rows
            sfa_ptrs = sfa_ptr + expert.to(tl.int64) * sfa_group_stride + offs_t
        a_ptrs = a_ptr + a_rows[None, :] * stride_a + offs_k[:, None]  # A^T tile [BLOCK_K, BLOCK_T]
        b_ptrs = b_ptr + expert.to(tl.int64) * stride_bg + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :]
        sfb_ptrs = sfb_ptr + expert.to(tl.int64) * sfb_group_stride + (pid_n * BLOCK_N // BLOCK_K) * sfb_n_stride
        kb_end = tl.minimum(kb0 + kb_per_split, NUM_KB)
        acc = _scaled_k_loop(tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32), a_ptrs, b_ptrs, sfa_ptrs, sfb_ptrs, t_ok,
                             n_ok, kb0, kb_end, k_valid, sfa_k_stride, BLOCK_K)
        d_ptrs = d_ptr + split * stride_split + rows[None, :] * stride_d + offs_n[:, None]
        tl.store(d_ptrs, acc.to(d_ptr.dtype.element_ty), mask=t_ok[None, :] & n_ok[:, None])


@triton.jit
def _fp8_grouped_gemm_segments_kernel(a_ptr, sfa_ptr, b_ptr, sfb_ptr, d_ptr, counts_ptr, psum_ptr, n, k_valid,
                                      stride_a, stride_bg, stride_bn, stride_d, sfa_k_stride, sfb_group_stride,
                                      sfb_n_stride, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                                      BLOCK_K: tl.constexpr, NUM_KB: tl.constexpr, PDL: tl.constexpr,
                                      EARLY_ROUTING: tl.constexpr):
    # One program per (column tile, local expert): the expert's weight tile streams through the K loop once per
    # BLOCK_T rows of its segment (once in all, when the segment fits), with the decode kernel's swapped dot.
    pid_n = tl.program_id(0)
    expert = tl.program_id(1)
    if EARLY_ROUTING:  # the down GEMM: the plan was written launches back (see the decode kernel)
        count = tl.load(counts_ptr + expert)
        end = tl.load(psum_ptr + expert)
    pdl_prologue(PDL)
    if not EARLY_ROUTING:
        count = tl.load(counts_ptr + expert)
        end = tl.load(psum_ptr + expert)
    start = end - count
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < n
    b_base = b_ptr + expert.to(tl.int64) * stride_bg + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :]
    sfb_ptrs = sfb_ptr + expert.to(tl.int64) * sfb_group_stride + (pid_n * BLOCK_N // BLOCK_K) * sfb_n_stride
    for t0 in range(0, count, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        t_ok = offs_t < count
        rows = (start + offs_t).to(tl.int64)
        a_ptrs = a_ptr + rows[None, :] * stride_a + offs_k[:, None]  # A^T tile [BLOCK_K, BLOCK_T]
        sfa_ptrs = sfa_ptr + rows
        acc = _scaled_k_loop(tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32), a_ptrs, b_base, sfa_ptrs, sfb_ptrs, t_ok,
                             n_ok, 0, NUM_KB, k_valid, sfa_k_stride, BLOCK_K)
        d_ptrs = d_ptr + rows[None, :] * stride_d + offs_n[:, None]
        tl.store(d_ptrs, acc.to(d_ptr.dtype.element_ty), mask=t_ok[None, :] & n_ok[:, None])


# H200, bench/moe.py decode section (2026-11-30): see kernels/moe/NOTES.md.
DECODE_CONFIG = dict(BLOCK_N=64, num_warps=4, num_stages=3)
DECODE_MAX_TOKENS = 64  # one BLOCK_T tile holds every row of an expert


# decode_splits by step size, overriding its rule (bench/decode_ab and bench/moe A/Bs)
SPLITS_BY_TOKENS: dict[int, int] = {}


def decode_splits(num_tokens: int) -> int:
    """K splits of the decode GEMM at T tokens. At T=1 one program's 23 serial 128-deep steps took ~14 us
    whatever the tile (a fixed cost: doubling N added 7.5 us, H200 2026-11-30); splitting K shortens the
    chain. Partial sums go out in fp32 [splits, rows, N] and the next stage adds them (no atomics).
    2-4 tokens (2-16 active experts, twice the programs or more) split in 2: 1.02x at b = 2 for 120b against 4 splits,
    3 splits slower (H200 2026-12-03, bench/results/decode_ab_small_t_splits_h200)."""
    if num_tokens in SPLITS_BY_TOKENS:
        return SPLITS_BY_TOKENS[num_tokens]
    return 4 if num_tokens <= 1 else 2 if num_tokens <= 4 else 1


def _decode_launch(config: dict | None, out: torch.Tensor, n: int, active: torch.Tensor) -> tuple[dict, int, tuple]:
    """(launch config, K splits, grid) of the decode kernel; checks the tile and the split-K output."""
    cfg = dict(DECODE_CONFIG, **(config or {}))
    if BLOCK % cfg["BLOCK_N"]:
        raise ValueError("BLOCK_N must divide 128 (one weight scale per tile)")
    splits = out.shape[0] if out.dim() == 3 else 1
    if splits > 1 and out.dtype != torch.float32:
        raise ValueError("split-K partial sums must be fp32")
    return cfg, splits, (triton.cdiv(n, cfg["BLOCK_N"]), active.numel(), splits)


def grouped_gemm_decode(a: Fp8Rows, w: torch.Tensor, w_scales: torch.Tensor, out: torch.Tensor,
                        counts: torch.Tensor, active: torch.Tensor, num_active: torch.Tensor, max_tokens: int,
                        config: dict | None = None, a_row_map: torch.Tensor | None = None,
                        plan_written_before_predecessor: bool = False, k_valid: int | None = None) -> torch.Tensor:
    """Masked-layout grouped GEMM for decode: out rows [e * m_cap, e * m_cap + counts[e]) = A @ W[e]^T for
    the experts active[:num_active] (`routing_triton.plan_masked`). `max_tokens` >= every count
    (the step's T); one program row per possible active expert, len(active) of them.
    `out` [rows, N] gets the products; `out` [S, rows, N] (fp32) gets S partial sums over K splits.
    With `a_row_map` [rows] (decode_front_triton's token_of_row) A is one group of T token rows (T = the
    layout's m_cap) and layout row r reads A row a_row_map[r]; out rows stay the layout's.
    plan_written_before_predecessor: counts / active / num_active come from a kernel before this launch's
    predecessor (the down GEMM), so under PDL they are read before the wait.
    k_valid: the real K (<= Kp); weight and A columns from it on are the zero padding and are not read (the
    products are the same: those columns multiply to zero either way). None reads all Kp columns."""
    e, n, kp = w.shape
    if a.data.shape[1] != kp or w_scales.shape != (e, -(-n // BLOCK), kp // BLOCK):
        raise ValueError(f"A is [*, {a.data.shape[1]}], W {tuple(w.shape)} with scales {tuple(w_scales.shape)}: "
                         f"K must match and W's scales must be [E, ceil(N/128), K/128]")
    if a_row_map is not None and a.groups != 1:
        raise ValueError(f"a_row_map needs A as one group of token rows, got {a.groups} groups")
    if k_valid is not None and not kp - BLOCK < k_valid <= kp:
        raise ValueError(f"k_valid {k_valid} must lie in the last 128-column block of Kp {kp}")
    if max_tokens > DECODE_MAX_TOKENS or max_tokens > a.rows_per_group:
        raise ValueError(f"grouped_gemm_decode covers up to {DECODE_MAX_TOKENS} rows per expert (and m_cap {a.rows_per_group}); got {max_tokens}")
    cfg, splits, grid = _decode_launch(config, out, n, active)
    _fp8_grouped_gemm_decode_kernel[grid](
        a.data, a.scale_storage, w, w_scales, out, counts, active, num_active,
        a_row_map if a_row_map is not None else counts, a.rows_per_group, n, kp if k_valid is None else k_valid,
        a.data.stride(0), w.stride(0), w.stride(1), out.stride(-2),
        out.stride(0) if splits > 1 else 0,
        a.sf_group_stride, a.sf_k_stride, w_scales.stride(0), w_scales.stride(1),
        BLOCK_T=max(16, triton.next_power_of_2(max_tokens)), BLOCK_K=BLOCK, NUM_KB=kp // BLOCK, SPLIT_K=splits,
        A_ROW_MAP=a_row_map is not None, EARLY_ROUTING=plan_written_before_predecessor,
        **cfg, **pdl.launch(out))
    return out


# H200 sweep (bench/moe_segments.py): see kernels/moe/NOTES.md, "Weight-streaming GEMMs over contiguous segments".
SEGMENTS_CONFIG = dict(BLOCK_N=64, num_warps=4, num_stages=3)


def segments_block_t(rows_per_expert: float) -> int:
    """BLOCK_T for segments of about `rows_per_expert` rows: 32 up to 31 rows, else the power of two above (at most
    128). A longer segment takes more passes over its weight tile (again from L2). On an H100 (2026-12-06,
    bench/results/moe_segments_h100.json) 32 was as fast as 16 at 3-4 rows per expert and 1.2x faster than 64 at 12-16;
    the layer beat DeepGEMM up to ~16 rows per expert and lost from ~32."""
    return min(128, max(32, triton.next_power_of_2(int(rows_per_expert) + 1)))


def grouped_gemm_segments(a: Fp8Rows, w: torch.Tensor, w_scales: torch.Tensor, out: torch.Tensor,
                          counts: torch.Tensor, psum: torch.Tensor, block_t: int, config: dict | None = None,
                          plan_written_before_predecessor: bool = False, k_valid: int | None = None) -> torch.Tensor:
    """Contiguous-layout grouped GEMM that streams each expert's weights once per `block_t` rows of its segment:
    out rows [psum[e] - counts[e], psum[e]) = A rows @ W[e]^T (`routing_triton.plan_contiguous`; A one group).
    Rows outside every segment (the alignment padding) are neither read nor written. For the sizes between decode
    and prefill (a few to ~100 rows per expert), where the GEMM is bound by weight bytes, not by FLOPs.
    k_valid and plan_written_before_predecessor as in grouped_gemm_decode."""
    e, n, kp = w.shape
    if a.data.shape[1] != kp or w_scales.shape != (e, -(-n // BLOCK), kp // BLOCK):
        raise ValueError(f"A is [*, {a.data.shape[1]}], W {tuple(w.shape)} with scales {tuple(w_scales.shape)}: "
                         f"K must match and W's scales must be [E, ceil(N/128), K/128]")
    if a.groups != 1 or counts.shape != (e,) or psum.shape != (e,) or out.shape != (a.data.shape[0], n):
        raise ValueError(f"segments need A as one group, counts and psum [{e}] and out [{a.data.shape[0]}, {n}]; got "
                         f"{a.groups} groups, {tuple(counts.shape)}, {tuple(psum.shape)}, {tuple(out.shape)}")
    if k_valid is not None and not kp - BLOCK < k_valid <= kp:
        raise ValueError(f"k_valid {k_valid} must lie in the last 128-column block of Kp {kp}")
    if block_t not in (16, 32, 64, 128):
        raise ValueError(f"block_t must be 16, 32, 64 or 128, got {block_t}")
    cfg = dict(SEGMENTS_CONFIG, **(config or {}))
    if BLOCK % cfg["BLOCK_N"]:
        raise ValueError("BLOCK_N must divide 128 (one weight scale per tile)")
    _fp8_grouped_gemm_segments_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), e)](
        a.data, a.scale_storage, w, w_scales, out, counts, psum, n, kp if k_valid is None else k_valid,
        a.data.stride(0), w.stride(0), w.stride(1), out.stride(0), a.sf_k_stride, w_scales.stride(0),
        w_scales.stride(1), BLOCK_T=block_t, BLOCK_K=BLOCK, NUM_KB=kp // BLOCK,
        EARLY_ROUTING=plan_written_before_predecessor, **cfg, **pdl.launch(out))
    return out
