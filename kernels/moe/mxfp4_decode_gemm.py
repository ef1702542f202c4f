"""Decode-sized grouped GEMM straight from the checkpoints' MXFP4 expert weights (fp16 activations).

At batch 1 a MoE layer is a weight stream: FP8 experts are 25.4 MB per expert of gpt-oss (gate_up + down),
MXFP4 13.4 MB (4 bits + one 8-bit exponent per 32 weights), so reading the checkpoint's own format would
halve the bytes of the dominant decode kernel (and 120b's experts would fit in ~61 GB instead of 117 GB).
It also computes as the reference does (MXFP4 weights exactly, activations unquantized).

**Measured slower than the FP8 decode GEMM on the H200** (2026-11-30, `python -m bench.mxfp4_decode`,
`bench/results/mxfp4_decode_h200.json` and `mxfp4_decode_v1_h200.json`): 20b gate_up at T=1 23.3 us
(1.5 TB/s of MXFP4 bytes) against 19.6 us for FP8 (3.5 TB/s), down 12.7 vs 8.5 us, and 1.2-1.8 TB/s at
T = 4..16. The unpack is issue-bound, not memory-bound: the H200 has ~2 integer ops per weight at 4 TB/s of
MXFP4 bytes and this kernel spends ~2.5. Earlier variants were slower still (a select/exp2 unpack in fp32:
0.5 TB/s; one 32-deep dot per MXFP4 group with the accumulator rescaled after each: 1.3 TB/s).
Not wired into the model; kept (tested) as the measured baseline for a faster unpack. Twin:
`reference_decode_mxfp4`.

The unpack: `pack_prescaled_words` rearranges every 8 codes into one 32-bit word so that four masked
shifts give four fp16x2 registers directly. An E2M1 magnitude code (e1 e0 m) placed at fp16 bits 11..9
reads as its value times 2^-14 (e = 0 lands on the fp16 subnormal 2^-15 = 0.5 x 2^-14), so fp16 bits =
(code & 7) << 9 | sign << 15, no arithmetic. Pair j of a word takes its magnitudes from bits 3j..3j+2
(+16 for the high half) and its signs from bit 12 + j (+16): r_j = (W << (9 - 3j)) & 0x0E000E00 |
(W << (3 - j)) & 0x80008000.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import pdl_prologue
from model.mxfp4 import dequantize_mxfp4

DECODE_MAX_TOKENS = 64


def _word_position(j: int, h: int) -> int:
    """K offset (0..7) inside a word of the value that pair j, half h unpacks to (the kernel's sub-dots)."""
    return 4 * h + 2 * (j % 2) + j // 2


def _pack_words(blocks: torch.Tensor) -> torch.Tensor:
    """Checkpoint MXFP4 blocks [E, N, G, 16] uint8 -> words [E, G, N, 4] int32: each group's 32 codes as
    4 words, group-major."""
    e, n, g, _ = blocks.shape
    words = torch.empty(e, g, n, 4, dtype=torch.int32, device=blocks.device)
    for x in range(e):  # one expert at a time: int64 scratch of 32 x its bytes
        codes = torch.stack([blocks[x] & 0xF, blocks[x] >> 4], -1).view(n, g, 4, 8).to(torch.int64)  # K order
        word = torch.zeros(n, g, 4, dtype=torch.int64, device=blocks.device)
        for j in range(4):
            for h in range(2):
                c = codes[..., _word_position(j, h)]
                word |= (c & 7) << (3 * j + 16 * h)
                word |= (c >> 3) << (12 + j + 16 * h)
        words[x] = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32).transpose(0, 1)
    return words


def reference_decode_mxfp4(a: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor,
                           rows_per_group: int, a_row_map: torch.Tensor | None = None) -> torch.Tensor:
    """Twin: [E * rows_per_group, N] fp32, rows of expert e at [e * m, e * m + counts[e]) = A rows @
    dequantize_mxfp4(W[e])^T (bf16 weights, fp32 sums); other rows zero."""
    e, n = blocks.shape[:2]
    out = torch.zeros(e * rows_per_group, n, dtype=torch.float32, device=a.device)
    for x in range(e):
        c = int(counts[x])
        if c == 0:
            continue
        rows = torch.arange(x * rows_per_group, x * rows_per_group + c, device=a.device)
        src = a_row_map[rows].long() if a_row_map is not None else rows
        w = dequantize_mxfp4(blocks[x], scales[x], torch.bfloat16).float()
        out[rows] = a[src].float() @ w.T
    return out


# A step is 128 deep (16 words, 4 groups) and the group scale is
# folded into the weights: with smax the largest scale of the row, each group's weights are
# v x 2^(scale - smax), formed as fp16x2 = (E2M1 bits, v x 2^-14) x 2^(scale - smax + 14) with one
# packed fp16 multiply per two weights; the accumulator takes 2^(smax - 127) once at the end. Exact while
# scale - smax >= -23 (the fp16 subnormal floor; `pack_prescaled_words` counts the groups below it, and
# groups below -28 are dropped: their weights are < 2^-28 of the row's largest). The 8 sub-dots of a
# step are one (pair, half) each: K offsets 8 w + position(pair, half) for the 16 words, so nothing is
# joined or reshaped and the unpack stays elementwise from the loaded words.

PRESCALED_CONFIG = dict(BLOCK_N=64, num_warps=4, num_stages=3)


def pack_prescaled_words(blocks: torch.Tensor, scales: torch.Tensor) -> dict:
    """Checkpoint MXFP4 [E, N, G, 16] + [E, N, G] -> {"words": [E, Kp/128, N, 16] int32 (K zero-padded to
    a multiple of 128), "fexp": [E, Kp/32, N] uint8 (fp16 exponent field of 2^(scale - smax + 14), 0 = drop),
    "rowexp": [E, N] uint8 (smax), "inexact_groups": groups with scale - smax < -23}."""
    e, n, g, sixteen = blocks.shape
    if sixteen != 16 or scales.shape != (e, n, g):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    gp = -(-g // 4) * 4
    if gp != g:
        blocks = torch.cat([blocks, blocks.new_zeros(e, n, gp - g, 16)], 2)
        scales = torch.cat([scales, scales.new_zeros(e, n, gp - g)], 2)
    words = _pack_words(blocks)  # [E, Gp, N, 4]
    words = words.view(e, gp // 4, 4, n, 4).permute(0, 1, 3, 2, 4).reshape(e, gp // 4, n, 16).contiguous()
    nonzero = blocks.view(e, n, gp, 16).ne(0).any(-1)
    smax = scales.masked_fill(~nonzero, 0).amax(-1)  # all-zero groups do not set the row's exponent
    d = scales.to(torch.int32) - smax[..., None].to(torch.int32)
    fexp = torch.where(nonzero, (d + 29).clamp(min=0), torch.zeros_like(d)).to(torch.uint8)
    return {"words": words, "fexp": fexp.permute(0, 2, 1).contiguous(), "rowexp": smax.contiguous(),
            "inexact_groups": int((nonzero & (d < -23)).sum())}


@triton.jit
def _scale_and_split(r, fpair, USE_ASM: tl.constexpr):
    """fp16x2 words r times fp16x2 factors fpair -> (low, high) fp16 tensors."""
    if USE_ASM:
        rs = tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [r, fpair], dtype=tl.uint32,
                                       is_pure=True, pack=1)
        lo, hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [rs], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=1)
    else:  # Triton's interpreter runs no PTX: the same products, one half at a time
        f = (fpair & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        lo = (r & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True) * f
        hi = (r >> 16).to(tl.uint16).to(tl.float16, bitcast=True) * f
    return lo, hi


@triton.jit
def _mxfp4_prescaled_gemm_kernel(a_ptr, words_ptr, fexp_ptr, rowexp_ptr, d_ptr, counts_ptr, active_ptr,
                                 num_active_ptr, a_row_map_ptr, rows_per_group, n, k, steps, stride_a, stride_we,
                                 stride_ws, stride_fe, stride_fg, stride_re, stride_d, stride_split,
                                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                                 A_ROW_MAP: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    split = tl.program_id(2)
    if slot < tl.load(num_active_ptr):
        expert = tl.load(active_ptr + slot).to(tl.int64)
        count = tl.load(counts_ptr + expert)
        s_per_split = tl.cdiv(steps, SPLIT_K)
        s0 = split * s_per_split
        offs_t = tl.arange(0, BLOCK_T)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_w = tl.arange(0, 16)
        t_ok = offs_t < count
        n_ok = offs_n < n
        rows = expert * rows_per_group + offs_t
        if A_ROW_MAP:
            a_rows = tl.load(a_row_map_ptr + rows, mask=t_ok, other=0).to(tl.int64)
        else:
            a_rows = rows
        w_tile = words_ptr + expert * stride_we + offs_n[:, None] * 16 + offs_w[None, :]
        f_tile = fexp_ptr + expert * stride_fe + (offs_w // 4)[None, :] * stride_fg + offs_n[:, None]
        x_rows = a_ptr + a_rows[None, :] * stride_a
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for s in range(s0, tl.minimum(s0 + s_per_split, steps)):
            words = tl.load(w_tile + s * stride_ws, mask=n_ok[:, None], other=0).to(tl.uint32, bitcast=True)
            fe = tl.load(f_tile + s * 4 * stride_fg, mask=n_ok[:, None], other=0).to(tl.uint32)
            fpair = (fe << 10) | (fe << 26)
            kw = s * 128 + offs_w * 8  # K of each word's first value
            for j in tl.static_range(4):
                if j == 3:
                    r = words & 0x8E008E00
                else:
                    r = ((words << (9 - 3 * j)) & 0x0E000E00) | ((words << (3 - j)) & 0x80008000)
                lo, hi = _scale_and_split(r, fpair, USE_ASM)
                k_lo = kw + 2 * (j % 2) + j // 2  # _word_position(j, 0); the high half sits 4 further
                x_lo = tl.load(x_rows + k_lo[:, None], mask=t_ok[None, :] & (k_lo[:, None] < k), other=0.0)
                x_hi = tl.load(x_rows + k_lo[:, None] + 4, mask=t_ok[None, :] & (k_lo[:, None] + 4 < k), other=0.0)
                acc = tl.dot(lo, x_lo, acc)
                acc = tl.dot(hi, x_hi, acc)
        rowexp = tl.load(rowexp_ptr + expert * stride_re + offs_n, mask=n_ok, other=127).to(tl.int32)
        acc = acc * (rowexp << 23).to(tl.float32, bitcast=True)[:, None]  # 2^(smax - 127)
        d_ptrs = d_ptr + split * stride_split + rows[None, :] * stride_d + offs_n[:, None]
        tl.store(d_ptrs, acc.to(d_ptr.dtype.element_ty), mask=t_ok[None, :] & n_ok[:, None])


def grouped_gemm_decode_mxfp4_prescaled(a: torch.Tensor, packed: dict, out: torch.Tensor, counts: torch.Tensor,
                                        active: torch.Tensor, num_active: torch.Tensor, rows_per_group: int,
                                        max_tokens: int, a_row_map: torch.Tensor | None = None,
                                        config: dict | None = None) -> torch.Tensor:
    """a [rows or T, K] fp16 (pair rows of the masked layout, or token rows with `a_row_map`) and the
    `pack_prescaled_words` experts -> out rows [e * rows_per_group, + counts[e]) = A rows @ W[e]^T, [rows, N]
    (bf16) or [S, rows, N] (fp32 split-K partial sums, which the epilogues add), for active[:num_active]."""
    words, fexp, rowexp = packed["words"], packed["fexp"], packed["rowexp"]
    e, steps, n, sixteen = words.shape
    k = a.shape[1]
    if sixteen != 16 or fexp.shape != (e, steps * 4, n) or rowexp.shape != (e, n) or not 0 <= steps * 128 - k < 128 \
            or a.dtype != torch.float16:
        raise ValueError(f"MXFP4 prescaled words {tuple(words.shape)} do not match fp16 A [*, {k}] ({a.dtype})")
    if not 0 < max_tokens <= min(DECODE_MAX_TOKENS, rows_per_group):
        raise ValueError(f"grouped_gemm_decode_mxfp4_prescaled covers 1..{DECODE_MAX_TOKENS} rows per expert "
                         f"(and rows_per_group {rows_per_group}); got {max_tokens}")
    splits = out.shape[0] if out.dim() == 3 else 1
    if splits > 1 and out.dtype != torch.float32:
        raise ValueError("split-K partial sums must be fp32")
    cfg = dict(PRESCALED_CONFIG, **(config or {}))
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), active.numel(), splits)
    _mxfp4_prescaled_gemm_kernel[grid](
        a, words, fexp, rowexp, out, counts, active, num_active, a_row_map if a_row_map is not None else counts,
        rows_per_group, n, k, steps, a.stride(0), words.stride(0), words.stride(1), fexp.stride(0), fexp.stride(1),
        rowexp.stride(0), out.stride(-2), out.stride(0) if splits > 1 else 0,
        BLOCK_T=max(16, triton.next_power_of_2(max_tokens)), BLOCK_N=cfg["BLOCK_N"], SPLIT_K=splits,
        A_ROW_MAP=a_row_map is not None, USE_ASM=a.is_cuda, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl.launch(a))
    return out
