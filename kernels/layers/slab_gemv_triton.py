"""Decode projections of 1-4 tokens as one weight slab per program, on CUDA cores: y [T, N] = x @ W^T (+ b).

Why another GEMV: at batch 1 the QKV and O weights (20b: 15.1 / 11.8 MB in FP8, 29.5 / 23.6 MB in bf16) are
too small for a loop of pipelined [BLOCK_N, 128] tensor-core steps to reach the HBM rate: the FP8 GEMV
(fp8_gemv_triton) measured 1.6-1.8 TB/s there (kernels/layers/NOTES.md), each program a chain of ~6
dependent steps plus the split-K tail. Here each program issues every load of its [BLOCK_N, K_SPLIT] slab at
once (one 3-D load, no loop), so a grid of one wave has the whole matrix in flight, and computes on CUDA
cores: T <= 4 tokens need T fp32 FMAs per weight, below the load time at 4 TB/s.

Numerics: every weight is converted to fp32 (FP8 e4m3 and bf16 exactly); FP8 weights take their 128x128
block's power-of-two scale through x (x * s exact), x clamped to +-65504 as the tensor-core GEMV's fp16 operand
is, so the products are those of fp8_linear.reference and only the fp32 summation order differs. bf16
weights: the products of F.linear's, fp32 sums. The split-K tail is the other GEMVs' (`finish_split_k`:
fixed-order sum of the partials, bias, one rounding).

Weight columns past x's K (the FP8 weights' zero padding to 128s) are not read (fp8_quant.READ_K_PADDING).
WEIGHTS_FIRST issues the slab's loads before the PDL wait: weights are no predecessor's output (they never
change inside a CUDA graph), so only x waits for the previous kernel.
Twins: fp8_linear.reference (FP8), torch.nn.functional.linear (bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.layers import GEMV_MIN_BLOCK_N
from kernels.layers.gemv_triton import finish_split_k
from kernels.moe import fp8_quant
from kernels.pdl import pdl_prologue

MAX_TOKENS = 4  # the kernel's limit (BLOCK_T unrolled per token); fp8_linear.SLAB_MAX_TOKENS is where it pays
QBLOCK = 128  # FP8 scale block along K and N; also the slab's inner K extent
# The sweep's best at T = 1 and 2 for both shapes, QKV / O 7.1 / 5.8 us at T = 1 (bench/gemv_slab, H200 2026-12-02,
# bench/results/gemv_slab_v1_h200.json): 64 rows x 256 K per program, 960 / 720 programs
DEFAULT_CONFIG = dict(BLOCK_N=64, K_SPLIT=256, num_warps=4, weights_first=True)


@triton.jit
def _slab_gemv_kernel(x_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, partial_ptr, tickets_ptr, num_tokens, n, k_in, k_w,
                      stride_x, stride_w, stride_sw, stride_y, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, NKB: tl.constexpr, SPLIT_K: tl.constexpr,
                      WEIGHTS_FIRST: tl.constexpr, PDL: tl.constexpr):
    nb, split = tl.program_id(0), tl.program_id(1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = split * NKB + tl.arange(0, NKB)  # 128-wide K blocks of this split
    offs_k = offs_kb[:, None] * 128 + tl.arange(0, 128)[None, :]  # [NKB, 128]
    n_ok = offs_n < n
    w_ptrs = w_ptr + offs_n[:, None, None].to(tl.int64) * stride_w + offs_k[None, :, :]
    w_ok = n_ok[:, None, None] & (offs_k < k_w)[None, :, :]
    s_ptrs = sw_ptr + (nb * BLOCK_N // 128) * stride_sw + offs_kb  # BLOCK_N divides 128: one scale row, one per K block
    # the weights' block scales and the bias are no kernel's output: read before the PDL wait too, like the weights
    # (after it: 2.729 vs 2.705 ms per 120b b=1 step, bench/results/decode_ab_early_routing_h200)
    bias = None
    if HAS_SCALE:
        s = tl.load(s_ptrs, mask=offs_kb * 128 < k_w, other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if WEIGHTS_FIRST:
        w = tl.load(w_ptrs, mask=w_ok, other=0.0)
        pdl_prologue(PDL)
    else:
        pdl_prologue(PDL)
        w = tl.load(w_ptrs, mask=w_ok, other=0.0)
    w = w.to(tl.float32)
    offs_t = tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for t in tl.static_range(BLOCK_T):
        k_t = tl.where(t < num_tokens, k_in, 0)  # rows past num_tokens read as zeros
        xt = tl.load(x_ptr + t * stride_x + offs_k, mask=offs_k < k_t, other=0.0).to(tl.float32)
        if HAS_SCALE:
            xt = tl.minimum(tl.maximum(xt, -65504.0), 65504.0) * s[:, None]
        yt = tl.sum(tl.sum(w * xt[None, :, :], axis=2), axis=1)
        acc = tl.where(offs_t[None, :] == t, yt[:, None], acc)
    finish_split_k(acc, partial_ptr, tickets_ptr, b_ptr, y_ptr, nb, split, offs_n, offs_t, n, num_tokens, stride_y,
                   HAS_BIAS, BLOCK_N, BLOCK_T, SPLIT_K, bias)


def slab_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, bias: torch.Tensor | None,
              tickets: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [T, K] (T <= 4) @ W^T + bias [N] -> [T, N] in x's dtype. W: float8_e4m3 [N, Kp] (K padded to 128s, K <=
    Kp) with weight_scale [ceil(N/128), Kp/128], or bf16/fp16/fp32 [N, K] with weight_scale None."""
    t, k = x.shape
    n, kw = weight.shape
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    fp8 = weight_scale is not None
    ok = 0 < t <= MAX_TOKENS and k <= kw and (bias is None or bias.shape == (n,)) \
        and tickets.numel() >= triton.cdiv(n, GEMV_MIN_BLOCK_N) and cfg["BLOCK_N"] >= GEMV_MIN_BLOCK_N \
        and cfg["K_SPLIT"] % QBLOCK == 0 and triton.next_power_of_2(cfg["K_SPLIT"] // QBLOCK) == cfg["K_SPLIT"] // QBLOCK
    if fp8:
        ok = ok and kw % QBLOCK == 0 and weight_scale.shape == (triton.cdiv(n, QBLOCK), kw // QBLOCK) \
            and QBLOCK % cfg["BLOCK_N"] == 0
    else:
        ok = ok and kw == k
    if not ok:
        raise ValueError(f"slab_gemv: x {tuple(x.shape)} (1..{MAX_TOKENS} rows), weight {tuple(weight.shape)} "
                         f"{weight.dtype}, scales {None if weight_scale is None else tuple(weight_scale.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)}, {tickets.numel()} tickets, {cfg}")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    nkb = cfg["K_SPLIT"] // QBLOCK
    splits = triton.cdiv(kw, cfg["K_SPLIT"])
    block_t = triton.next_power_of_2(t)
    partial = torch.empty(splits if splits > 1 else 0, n, block_t, dtype=torch.float32, device=x.device)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    _slab_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), splits)](
        x, weight, weight_scale if fp8 else weight, bias if bias is not None else weight, y, partial, tickets, t, n, k,
        kw if fp8_quant.READ_K_PADDING else k, x.stride(0), weight.stride(0), weight_scale.stride(0) if fp8 else 0,
        y.stride(0), HAS_SCALE=fp8,
        HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_N=cfg["BLOCK_N"], NKB=nkb, SPLIT_K=splits,
        WEIGHTS_FIRST=cfg["weights_first"], num_warps=cfg["num_warps"], **pdl.launch(x))
    return y
