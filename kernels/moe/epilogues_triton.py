"""The memory-bound stages around the two grouped GEMMs, fused (Triton).

- dispatch_quant: quantize each token row of x per 128 channels to FP8 once and write it to each of
  its pairs' GEMM rows (DeepGEMM's A operand), zero-padding K 2880 -> 2944;
- swiglu_quant: GEMM-1 row + gate_up bias (DeepGEMM has no bias), de-interleave (gate = even
  columns, up = odd), clamp, SwiGLU, +1 on up, quantize for GEMM 2 (per pair; swiglu_quant_contiguous:
  the same per row tile of a contiguous layout, the bias loaded once per tile);
- combine: GEMM-2 row + down bias, times the routing weight, summed over each token's k slots in
  fp32 (a gather per token: no atomics, a fixed summation order).

One program per pair (a pair's row is unique) or per token; each reads its bytes once.
Scales are written MN-major (`Fp8Rows`), the layout DeepGEMM's SM90 kernels load with TMA, so no
transpose runs between the stages. Twins: fp8_reference.dispatch_quant / swiglu_quant / combine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.moe.fp8_quant import BLOCK, FP8, align
from kernels.pdl import pdl_prologue
from kernels.triton_rounding import round_to_bf16

# TMA needs the MN-major scale rows 16-byte aligned: 4 fp32 (DeepGEMM's get_tma_aligned_size).
SCALE_ROW_ALIGN = 4
# Above this many (token, expert) pairs a call is prefill-sized: the pairs alone fill the GPU (several k-blocks
# per program) and the approximate divisions are on by default.
PREFILL_PAIRS = 512


def prefill_sized(pairs: int) -> bool:
    return pairs > PREFILL_PAIRS


@dataclass
class Fp8Rows:
    """FP8 rows of a GEMM operand with 1x128 scales, grouped as [groups, rows_per_group, K].

    `data` [groups * rows_per_group, Kp]; `scale_storage` [groups, Kp/128, rows_aligned] holds the
    scales MN-major (row-contiguous per 128-channel block)."""

    data: torch.Tensor
    scale_storage: torch.Tensor
    rows_per_group: int

    @staticmethod
    def empty(groups: int, rows_per_group: int, k_padded: int, device) -> "Fp8Rows":
        rows_aligned = align(rows_per_group, SCALE_ROW_ALIGN)
        data = torch.empty(groups * rows_per_group, k_padded, dtype=FP8, device=device)
        scales = torch.empty(groups, k_padded // BLOCK, rows_aligned, dtype=torch.float32, device=device)
        return Fp8Rows(data, scales, rows_per_group)

    @staticmethod
    def from_rows(q: torch.Tensor, s: torch.Tensor) -> "Fp8Rows":
        """One group from row-major fp8 [M, Kp] and scales [M, Kp/128] (the twins' layout; a copy of s)."""
        out = Fp8Rows.empty(1, q.shape[0], q.shape[1], q.device)
        out.data.copy_(q)
        out.scale_storage[0, :, :q.shape[0]] = s.T
        return out

    @property
    def groups(self) -> int:
        return self.scale_storage.shape[0]

    @property
    def k_blocks(self) -> int:
        return self.scale_storage.shape[1]

    @property
    def sf_group_stride(self) -> int:
        return self.scale_storage.stride(0)

    @property
    def sf_k_stride(self) -> int:
        return self.scale_storage.stride(1)

    def scales_2d(self) -> torch.Tensor:
        """[rows, Kp/128] view (one group): what DeepGEMM's contiguous GEMM takes as A's scales."""
        s = self.scale_storage
        return s.as_strided((self.rows_per_group, s.shape[1]), (1, s.stride(1)))

    def scales_3d(self) -> torch.Tensor:
        """[groups, rows_per_group, Kp/128] view: the masked GEMM's scales."""
        s = self.scale_storage
        return s.as_strided((s.shape[0], self.rows_per_group, s.shape[1]), (s.stride(0), 1, s.stride(1)))

    def scales_rows(self) -> torch.Tensor:
        """[groups * rows_per_group, Kp/128], row-major copy (for comparisons)."""
        return self.scales_3d().reshape(-1, self.k_blocks)


@triton.jit
def _dispatch_quant_kernel(x_ptr, row_of_pair_ptr, a_ptr, sf_ptr, hidden, stride_x, stride_a,
                           rows_per_group, sf_group_stride, sf_k_stride,
                           TOP_K: tl.constexpr, NUM_KB: tl.constexpr, BLOCK_KB: tl.constexpr, BLOCK_J: tl.constexpr,
                           PDL: tl.constexpr, FAST_DIV: tl.constexpr = False):
    # grid (tokens, k-block groups): a token's 128-channel blocks are read and quantized once and stored
    # into each of its k pairs' rows (each block has its own scale, so blocks are independent).
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1) * BLOCK_KB + tl.arange(0, BLOCK_KB)
    col = kb[:, None] * 128 + tl.arange(0, 128)[None, :]
    v = tl.load(x_ptr + token * stride_x + col, mask=col < hidden, other=0.0).to(tl.float32)
    # Per-128 FP8 quantization; scale = max(amax, 1e-4) / 448 with IEEE division, as in the twin. FAST_DIV:
    # each value times 448 / amax (one IEEE division per block) instead of divided by the scale.
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-4)
    scale = tl.math.div_rn(amax, 448.0)
    if FAST_DIV:
        q = (v * tl.math.div_rn(448.0, amax)[:, None]).to(tl.float8e4nv)
    else:
        q = tl.math.div_rn(v, scale[:, None]).to(tl.float8e4nv)
    jj = tl.arange(0, BLOCK_J)
    rows = tl.load(row_of_pair_ptr + token * TOP_K + jj, mask=jj < TOP_K, other=-1).to(tl.int64)  # -1: not here
    ok = (rows >= 0)[:, None] & (kb < NUM_KB)[None, :]
    tl.store(a_ptr + rows[:, None, None] * stride_a + col[None, :, :],
             tl.broadcast_to(q[None, :, :], [BLOCK_J, BLOCK_KB, 128]), mask=ok[:, :, None])
    g = rows // rows_per_group
    tl.store(sf_ptr + (g * sf_group_stride + rows - g * rows_per_group)[:, None] + kb[None, :] * sf_k_stride,
             tl.broadcast_to(scale[None, :], [BLOCK_J, BLOCK_KB]), mask=ok)


@triton.jit
def swiglu_quant_rows(h, col_ok, alpha, limit, ROWS: tl.constexpr, FAST_DIV: tl.constexpr, MUFU: tl.constexpr = False):
    """h [ROWS, 256]: gate_up outputs + bias of 128 output channels, (gate, up) interleaved, fp32 -> the
    clamped SwiGLU quantized per row: FP8 [ROWS, 128] and scales [ROWS] (channels where col_ok is false are
    zero). FAST_DIV: approximate division (div.full, 2 ulp) and one reciprocal per block, off the twin's
    rounding."""
    gate, up = tl.split(tl.reshape(h, (ROWS, 128, 2)))
    return swiglu_quant_split(gate, up, col_ok, alpha, limit, FAST_DIV, MUFU)


@triton.jit
def _sigmoid_mufu(x):
    """1 / (1 + 2^x) from one ex2.approx.ftz and one rcp.approx.ftz (the SFU; flushes subnormals)."""
    return tl.inline_asm_elementwise(
        "{ .reg .f32 t; ex2.approx.ftz.f32 t, $1; add.ftz.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }",
        "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def swiglu_quant_split(gate, up, col_ok, alpha, limit, FAST_DIV: tl.constexpr, MUFU: tl.constexpr):
    """swiglu_quant_rows on gate and up [ROWS, 128] (fp32, bias added) already apart. col_ok None: the caller
    loaded channels past the end as zeros (gate 0 gives +0, as the select would). MUFU (with FAST_DIV, GPUs
    only: inline PTX): the sigmoid from ex2 + rcp approximations and gate * sigmoid * (up + 1) as one fma."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    if FAST_DIV:
        if MUFU:
            gs = gate * _sigmoid_mufu(gate * (-alpha * 1.4426950408889634))
            act = tl.fma(gs, up, gs)
        else:
            act = tl.fdiv(gate, 1.0 + tl.exp(-alpha * gate), ieee_rounding=False) * (up + 1.0)
        if col_ok is not None:
            act = tl.where(col_ok, act, 0.0)
        amax = tl.maximum(tl.max(tl.abs(act), axis=1), 1e-4)
        scale = tl.math.div_rn(amax, 448.0)
        q = (act * tl.math.div_rn(448.0, amax)[:, None]).to(tl.float8e4nv)
    else:
        act = gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)
        if col_ok is not None:
            act = tl.where(col_ok, act, 0.0)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(act), axis=1), 1e-4), 448.0)
        q = tl.math.div_rn(act, scale[:, None]).to(tl.float8e4nv)
    return q, scale


@triton.jit
def _swiglu_quant_kernel(h_ptr, row_of_pair_ptr, ids_ptr, bias_ptr, a_ptr, sf_ptr,
                         inter, stride_h, stride_split, stride_a, stride_bias, first_expert, alpha, limit,
                         rows_per_group, sf_group_stride, sf_k_stride,
                         NUM_KB: tl.constexpr, BLOCK_KB: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr,
                         FAST_DIV: tl.constexpr = False):
    pdl_prologue(PDL)
    # grid (pairs, k-block groups). Output column j comes from gate 2j and up 2j+1: each k-block reads
    # its 256 interleaved inputs as one contiguous run and splits them in registers.
    pair = tl.program_id(0)
    row = tl.load(row_of_pair_ptr + pair)
    if row >= 0:
        e = tl.load(ids_ptr + pair).to(tl.int32) - first_expert
        kb = tl.program_id(1) * BLOCK_KB + tl.arange(0, BLOCK_KB)
        src = kb[:, None] * 256 + tl.arange(0, 256)[None, :]  # interleaved (gate, up) inputs
        ok_src = src < 2 * inter
        h = tl.load(h_ptr + row.to(tl.int64) * stride_h + src, mask=ok_src, other=0.0).to(tl.float32)
        if SPLITS > 1:  # split-K partial sums of the decode GEMM, rounded as its unsplit bf16 output is
            for s in tl.static_range(1, SPLITS):
                h += tl.load(h_ptr + s * stride_split + row.to(tl.int64) * stride_h + src, mask=ok_src, other=0.0)
            h = round_to_bf16(h)
        h += tl.load(bias_ptr + e.to(tl.int64) * stride_bias + src, mask=ok_src, other=0.0)
        col = kb[:, None] * 128 + tl.arange(0, 128)[None, :]
        q, scale = swiglu_quant_rows(h, col < inter, alpha, limit, BLOCK_KB, FAST_DIV)
        tl.store(a_ptr + row.to(tl.int64) * stride_a + col, q, mask=kb[:, None] < NUM_KB)
        g = row // rows_per_group
        tl.store(sf_ptr + g.to(tl.int64) * sf_group_stride + kb * sf_k_stride + (row - g * rows_per_group),
                 scale, mask=kb < NUM_KB)


@triton.jit
def _swiglu_quant_tiles_kernel(h_ptr, m_indices_ptr, bias_ptr, a_ptr, sf_ptr, num_rows, inter, stride_h, stride_a,
                               stride_bias, alpha, limit, sf_k_stride,
                               BLOCK_R: tl.constexpr, FAST_DIV: tl.constexpr, PDL: tl.constexpr,
                               WORDS: tl.constexpr = False, MUFU: tl.constexpr = False):
    pdl_prologue(PDL)
    # grid (row tiles, k-blocks) over the contiguous layout: a tile of BLOCK_R rows lies inside one expert's
    # segment (segments start at multiples of BLOCK_R), so the tile loads its 256 bias values once, where
    # the per-pair kernel loads a bias value per element.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1)
    expert = tl.load(m_indices_ptr + rows, mask=rows < num_rows, other=-1)  # -1: alignment padding
    live = expert >= 0
    e = tl.max(expert, axis=0)
    if e >= 0:
        col = kb * 128 + tl.arange(0, 128)
        bias_row = bias_ptr + e.to(tl.int64) * stride_bias
        if WORDS:
            # h_ptr: the bf16 rows as int32 words (stride_h in words), one word per output channel: its low half
            # the gate (even column), its high half the up input. A bf16 is the top half of its fp32, so each
            # half goes to fp32 with one shift or mask and no split of an interleaved tile; same values.
            ok = col < inter
            w = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + col[None, :],
                        mask=live[:, None] & ok[None, :], other=0)
            gate = (w << 16).to(tl.float32, bitcast=True)
            up = (w & -65536).to(tl.float32, bitcast=True)
            gate += tl.load(bias_row + 2 * col, mask=ok, other=0.0)[None, :]
            up += tl.load(bias_row + 2 * col + 1, mask=ok, other=0.0)[None, :]
            q, scale = swiglu_quant_split(gate, up, None, alpha, limit, FAST_DIV, MUFU)
        else:
            src = kb * 256 + tl.arange(0, 256)  # interleaved (gate, up) inputs of output channels kb*128 ..
            ok_src = src < 2 * inter
            h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + src[None, :],
                        mask=live[:, None] & ok_src[None, :], other=0.0).to(tl.float32)
            h += tl.load(bias_row + src, mask=ok_src, other=0.0)[None, :]
            q, scale = swiglu_quant_rows(h, (col < inter)[None, :], alpha, limit, BLOCK_R, FAST_DIV, MUFU)
        tl.store(a_ptr + rows[:, None].to(tl.int64) * stride_a + col[None, :], q, mask=live[:, None])
        tl.store(sf_ptr + kb * sf_k_stride + rows, scale, mask=live)


def _kb_per_program(pairs: int, num_kb: int) -> int:
    """k-blocks per program: one while there are few pairs (decode: spread a row over the SMs), more once
    pairs alone fill the GPU (prefill: fewer, larger programs)."""
    return min(8, triton.next_power_of_2(num_kb)) if prefill_sized(pairs) else 1


@triton.jit
def _combine_kernel(y_ptr, row_of_pair_ptr, ids_ptr, weights_ptr, bias_ptr, out_ptr,
                    hidden, stride_y, stride_split, stride_bias, stride_out, first_expert,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    # every pair's loads in one basic block (masked where the pair is another rank's, row -1): the k pairs' rows
    # stream together instead of one pair's round trip after the previous one's branch (H200 2026-12-03, replayed
    # b = 1 steps: 20b 1.775 -> 1.751 ms, 120b 2.735 -> 2.714; kernels/moe/NOTES.md). Fixed pair order, fp32.
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        row = tl.load(row_of_pair_ptr + pair)
        live = (cols * 0 + row) >= 0  # [BLOCK_H]: a block mask (the interpreter takes no scalar in one)
        e = tl.where(row >= 0, tl.load(ids_ptr + pair).to(tl.int32) - first_expert, 0)
        w = tl.load(weights_ptr + pair).to(tl.float32)
        src = y_ptr + tl.maximum(row, 0).to(tl.int64) * stride_y + cols
        y = tl.load(src, mask=ok & live, other=0.0).to(tl.float32)
        if SPLITS > 1:
            for s in tl.static_range(1, SPLITS):
                y += tl.load(src + s * stride_split, mask=ok & live, other=0.0)
            y = round_to_bf16(y)
        y += tl.load(bias_ptr + e.to(tl.int64) * stride_bias + cols, mask=ok & live, other=0.0)
        acc = tl.where(live, acc + w * y, acc)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def dispatch_quant(x: torch.Tensor, row_of_pair: torch.Tensor, top_k: int, out: Fp8Rows,
                   fast_div: bool = False, kb_per_program: int | None = None,
                   num_warps: int | None = None) -> Fp8Rows:
    """Quantize x [T, D] into the rows of `out` that the pairs map to. fast_div: each value times 448 / amax
    (one IEEE division per 128-channel block) instead of an IEEE division per value; a code may land one FP8
    step off the twin's. kb_per_program (a power of two) / num_warps: the launch's shape (None: by the number of
    pairs, _kb_per_program; bench.dispatch_ab sweeps them); the output does not depend on them."""
    if x.stride(1) != 1:
        x = x.contiguous()
    p = row_of_pair.numel()
    if p:
        kbp = kb_per_program or _kb_per_program(p, out.k_blocks)
        if kbp & (kbp - 1):
            raise ValueError(f"kb_per_program must be a power of two, got {kbp}")
        _dispatch_quant_kernel[(p // top_k, triton.cdiv(out.k_blocks, kbp))](
            x, row_of_pair, out.data, out.scale_storage, x.shape[1], x.stride(0), out.data.stride(0),
            out.rows_per_group, out.sf_group_stride, out.sf_k_stride,
            TOP_K=top_k, NUM_KB=out.k_blocks, BLOCK_KB=kbp, BLOCK_J=triton.next_power_of_2(top_k),
            FAST_DIV=fast_div, num_warps=num_warps or (1 if kbp == 1 else 4), **pdl.launch(x))
    return out


def swiglu_quant(h: torch.Tensor, row_of_pair: torch.Tensor, expert_ids: torch.Tensor, bias: torch.Tensor,
                 first_expert: int, alpha: float, limit: float, out: Fp8Rows, fast_div: bool | None = None) -> Fp8Rows:
    """GEMM-1 output rows h [rows, 2I] (bf16), or [S, rows, 2I] split-K partial sums (fp32) -> FP8 rows of
    the SwiGLU activation [rows, Ip].

    fast_div: approximate divisions (the sigmoid's and the quantization's, as a per-block reciprocal).
    None: on for prefill-sized calls (> 512 pairs), where they measured 1.13-1.14x (20b 4k 116.7 -> 103.4
    us, 120b 8k 223.6 -> 196.7 us; bench/swiglu_ab, H200 2026-11-30; a second run's log in
    bench/results/swiglu_ab_h200.log) with the same fraction of codes one
    FP8 step off the twin's (~1e-6) and none further; off for decode (5.3 vs 5.7 us at T=1)."""
    p = row_of_pair.numel()
    if fast_div is None:
        fast_div = prefill_sized(p)
    splits = h.shape[0] if h.dim() == 3 else 1
    if p:
        kbp = _kb_per_program(p, out.k_blocks)
        _swiglu_quant_kernel[(p, triton.cdiv(out.k_blocks, kbp))](
            h, row_of_pair, expert_ids, bias, out.data, out.scale_storage,
            h.shape[-1] // 2, h.stride(-2), h.stride(0) if splits > 1 else 0, out.data.stride(0), bias.stride(0),
            first_expert, float(alpha), float(limit), out.rows_per_group, out.sf_group_stride, out.sf_k_stride,
            NUM_KB=out.k_blocks, BLOCK_KB=kbp, SPLITS=splits, FAST_DIV=fast_div, num_warps=1 if kbp == 1 else 4,
            **pdl.launch(h))
    return out


def swiglu_quant_contiguous(h: torch.Tensor, m_indices: torch.Tensor, bias: torch.Tensor, alpha: float, limit: float,
                            out: Fp8Rows, segment_align: int, num_pairs: int, fast_div: bool | None = None,
                            block_rows: int = 32, num_warps: int = 4, words: bool = False,
                            mufu: bool = False) -> Fp8Rows:
    """swiglu_quant over a contiguous-layout plan (routing_triton.plan_contiguous), tiled by rows: the same
    values per row, bit for bit, written to the same rows (rows whose m_indices is -1 are left alone).
    m_indices [rows]: the local expert of each row; segments start at multiples of `segment_align`, which
    block_rows must divide. fast_div None: on above 512 pairs, as swiglu_quant decides.

    words: load each (gate, up) pair of h as one int32 word (no split of an interleaved tile in registers or
    shared memory); bit for bit the same output. mufu (GPUs, only where fast_div is on): the sigmoid from the
    SFU's ex2 / rcp approximations and one fma, off the fast division's rounding by a few ulp before the cast."""
    rows = h.shape[0]
    if h.dim() != 2 or m_indices.shape != (rows,) or out.groups != 1 or out.rows_per_group != rows:
        raise ValueError(f"h {tuple(h.shape)} (bf16 rows), m_indices {tuple(m_indices.shape)} and one group of "
                         f"{out.rows_per_group} FP8 rows must describe the same {rows} rows")
    if segment_align % block_rows:
        raise ValueError(f"block_rows {block_rows} must divide the segment alignment {segment_align}")
    if fast_div is None:
        fast_div = prefill_sized(num_pairs)
    if mufu and not h.is_cuda:
        raise ValueError("mufu is inline PTX: CUDA tensors only")
    if words:
        if h.dtype != torch.bfloat16 or h.stride(1) != 1 or h.stride(0) % 2 or h.storage_offset() % 2:
            raise ValueError(f"words needs bf16 rows of even stride and offset, got {h.dtype} strides {h.stride()}")
        h_arg, stride_h = h.view(torch.int32), h.stride(0) // 2
    else:
        h_arg, stride_h = h, h.stride(0)
    if rows:
        _swiglu_quant_tiles_kernel[(triton.cdiv(rows, block_rows), out.k_blocks)](
            h_arg, m_indices, bias, out.data, out.scale_storage, rows, h.shape[1] // 2, stride_h, out.data.stride(0),
            bias.stride(0), float(alpha), float(limit), out.sf_k_stride,
            BLOCK_R=block_rows, FAST_DIV=fast_div, WORDS=words, MUFU=mufu and fast_div, num_warps=num_warps,
            **pdl.launch(h))
    return out


def combine(y: torch.Tensor, row_of_pair: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
            bias: torch.Tensor, first_expert: int, out: torch.Tensor) -> torch.Tensor:
    """out [T, D] = sum_j w[t, j] * (y[row(t, j)] + bias[e]) over this rank's experts; y [rows, D], or
    [S, rows, D] split-K partial sums (fp32)."""
    t, k = expert_ids.shape
    splits = y.shape[0] if y.dim() == 3 else 1
    if t:
        block_h = 256 if t <= 64 else 1024  # decode: a few tokens, spread each row over more programs
        _combine_kernel[(t, triton.cdiv(out.shape[1], block_h))](
            y, row_of_pair, expert_ids, expert_weights, bias, out, out.shape[1], y.stride(-2),
            y.stride(0) if splits > 1 else 0, bias.stride(0), out.stride(0), first_expert,
            TOP_K=k, BLOCK_H=block_h, SPLITS=splits, num_warps=4, **pdl.launch(out))
    return out
