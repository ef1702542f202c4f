"""Decode-sized dense projections with FP8 weights: y [T, N] = x @ dequant(W)^T (+ b), T <= 64 (opt-in, see fp8_linear).

W is float8_e4m3 [N, Kp] with one fp32 scale per 128x128 block. The activations are not quantized:
x (bf16) is converted to fp16 (exact for |x| in [2^-14, 65504]; clamped there, see fp8_linear) and every
e4m3 weight is exactly an fp16 value, so each 128-deep step is one fp16 tensor-core dot of exact
products with fp32 sums, times the block's scale. Weight-only quantization: the only rounding is the
weights', once, at load.

Why not FP8 activations (the MoE's scheme) here: a first version quantized x per token per 128 channels
inside every program (x is a few kB) and ran 34 us per call where bf16 weights take ~7 (20b decode step
2.19 -> 3.11 ms, H200 2026-11-30, bench/results/decode_ab_fp8_dense_v1_h200.json): a [128, 16] amax
reduction and 2048 IEEE divisions per 128-deep step left the kernel instruction-bound. The fp8 -> fp16
conversion is one instruction per two weights.

Same split-K scheme as gemv_triton (bf16), sharing its epilogue (`finish_split_k`): grid (N blocks, K
splits), fp32 partial sums, and the last program of each N block (atomic ticket, reset by it) sums the
splits in a fixed order, adds the bias and rounds once. Halving the weight bytes is the point: the
unembedding (1.16 GB in bf16) streams at 3.4-3.9 TB/s here, 1.6-1.8x cuBLAS's time at <= 16 tokens
(bench/results/gemv_fp8_h200.json, kernels/layers/NOTES.md).
Twin: fp8_linear.reference (dequantized weights, fp32 matmul, + bias, one rounding).

`dequantize` writes the exact bf16 image of an FP8 weight (power-of-two block scales) for cuBLAS at T > 64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.layers import GEMV_MIN_BLOCK_N
from kernels.layers.fp8_linear import GEMV_MAX_TOKENS
from kernels.layers.gemv_triton import finish_split_k, num_sms, num_splits
from kernels.moe import fp8_quant
from kernels.pdl import pdl_prologue

QBLOCK = 128  # the quantization block along K (and N for the weights)
DEFAULT_CONFIG = dict(BLOCK_N=64, waves=2, num_warps=4, num_stages=4)
# Projections with at least LARGE_N outputs (the unembedding, 201088): 128-row blocks, 4 waves, 3 stages. H200,
# bench/gemv_sweep (graphs of 50 calls), us at T = 1 / 4 / 16 / 32 / 64: 152.7 / 164.7 / 171.9 / 233.0 / 347.8 against
# DEFAULT_CONFIG's 179.7 / 184.6 / 189.2 / 244.4 / 390.7 (bench/results/gemv_fp8_h200.json, 2026-11-30; 148.2 vs
# 178.2 at T = 1 again on 2026-12-03, gemv_fp8_unembed_h200.json). QKV and O (5120 / 2880 outputs) stay on the
# default, faster there. (Until 2026-12-03 every shape ran the default: the unembedding lost ~30 us a step.)
LARGE_N = 65536
LARGE_N_CONFIG = dict(BLOCK_N=128, waves=4, num_warps=4, num_stages=3)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, partial_ptr, tickets_ptr, num_tokens, n, k, k_w,
                     stride_x, stride_w, stride_sw, stride_y, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_N: tl.constexpr, NUM_KB: tl.constexpr, KB_PER_SPLIT: tl.constexpr,
                     SPLIT_K: tl.constexpr, DOT_F16: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    nb, split = tl.program_id(0), tl.program_id(1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    n_ok = offs_n < n
    t_ok = offs_t < num_tokens
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    sw_row = sw_ptr + (nb * BLOCK_N // 128) * stride_sw  # BLOCK_N divides 128: one weight scale per step
    kb0 = split * KB_PER_SPLIT
    for kb in range(kb0, tl.minimum(kb0 + KB_PER_SPLIT, NUM_KB)):
        offs_k = kb * 128 + tl.arange(0, 128)
        # columns from k_w on (the zero K padding, unless fp8_quant.READ_K_PADDING) are not read
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :],
                    mask=n_ok[:, None] & (offs_k < k_w)[None, :], other=0.0)
        xv = tl.load(x_ptr + offs_t[None, :] * stride_x + offs_k[:, None], mask=t_ok[None, :] & (offs_k < k)[:, None],
                     other=0.0).to(tl.float32)  # x^T block [128, BLOCK_T]; K padding reads as zeros
        xh = tl.minimum(tl.maximum(xv, -65504.0), 65504.0).to(tl.float16)
        if DOT_F16:
            part = tl.dot(w.to(tl.float16), xh)
        else:  # Triton's interpreter: fp32 operands (the same exact products)
            part = tl.dot(w.to(tl.float32), xh.to(tl.float32), input_precision="ieee")
        acc += part * tl.load(sw_row + kb)
    finish_split_k(acc, partial_ptr, tickets_ptr, b_ptr, y_ptr, nb, split, offs_n, offs_t, n, num_tokens, stride_y,
                   HAS_BIAS, BLOCK_N, BLOCK_T, SPLIT_K)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
             tickets: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [T, K] (T <= 64, K <= Kp) @ dequant(weight [N, Kp], weight_scale [ceil(N/128), Kp/128])^T + bias [N]
    -> [T, N] in x's dtype."""
    t, k = x.shape
    n, kp = weight.shape
    cfg = dict(LARGE_N_CONFIG if n >= LARGE_N else DEFAULT_CONFIG, **(config or {}))
    if not 0 < t <= GEMV_MAX_TOKENS or kp % QBLOCK or k > kp or weight_scale.shape != (triton.cdiv(n, QBLOCK), kp // QBLOCK) \
            or (bias is not None and bias.shape != (n,)) or tickets.numel() < triton.cdiv(n, GEMV_MIN_BLOCK_N) \
            or QBLOCK % cfg["BLOCK_N"] or cfg["BLOCK_N"] < GEMV_MIN_BLOCK_N:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} (1..{GEMV_MAX_TOKENS} rows), weight {tuple(weight.shape)} "
                         f"(K padded to 128s), scales {tuple(weight_scale.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)}, {tickets.numel()} tickets, {cfg}")
    if x.stride(1) != 1:
        x = x.contiguous()
    splits, per = num_splits(n, kp, num_sms(x.device), dict(cfg, BLOCK_K=QBLOCK))  # per: a multiple of 128
    block_t = max(16, triton.next_power_of_2(t))
    partial = torch.empty(splits if splits > 1 else 0, n, block_t, dtype=torch.float32, device=x.device)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), splits)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, y, partial, tickets, t, n, k,
        kp if fp8_quant.READ_K_PADDING else k, x.stride(0), weight.stride(0), weight_scale.stride(0), y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_T=block_t, BLOCK_N=cfg["BLOCK_N"], NUM_KB=kp // QBLOCK, KB_PER_SPLIT=per // QBLOCK, SPLIT_K=splits,
        DOT_F16=x.is_cuda, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl.launch(x))
    return y


@triton.jit
def _dequantize_kernel(w_ptr, sw_ptr, out_ptr, n, k, stride_w, stride_sw, stride_out, BLOCK_N: tl.constexpr):
    nb, kb = tl.program_id(0), tl.program_id(1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = kb * 128 + tl.arange(0, 128)
    ok = (offs_n < n)[:, None] & (offs_k < k)[None, :]
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :], mask=ok, other=0.0)
    scale = tl.load(sw_ptr + (nb * BLOCK_N // 128) * stride_sw + kb)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_out + offs_k[None, :],
             (w.to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """[N, Kp] fp8 with 128x128 scales -> [N, k] in `dtype` (exact in bf16 for power-of-two scales)."""
    n, kp = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    block_n = 64
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, QBLOCK))](
        weight, weight_scale, out, n, k, weight.stride(0), weight_scale.stride(0), out.stride(0), BLOCK_N=block_n)
    return out
