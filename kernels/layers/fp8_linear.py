"""Dense projections with FP8 weights: the unembedding with `lm_head_dtype="fp8_e4m3"` (weight-only), QKV and O
with `dense_dtype="fp8_e4m3"` (FP8 activations too above 64 tokens). Both opt-in.

The checkpoints hold the dense projections in bf16; an Fp8Linear rounds one once at load to
float8_e4m3 with one power-of-two fp32 scale per 128x128 block (K zero-padded to a multiple of 128).
Every FP8 weight times its power-of-two scale is exactly a bf16 value, so weight-only, the model computed is
the bf16 model with its dense weights rounded to FP8 (~2^-5 relative, RMS), nothing else: activations are never
quantized at decode, and every token count up to 64 takes the same numerics (up to fp32 summation order). Half the
bytes of the bf16 weights; the default stays bf16 (the model then matches the reference) and this is a choice the
operator makes. At decode of 1-2 tokens the slab GEMV reads QKV / O's FP8 weights in 7.1 / 5.8 us where their
bf16 kernels take 10.1 / 9.1 (weights from HBM, H200, bench/gemv_slab); the tensor-core FP8 GEMV did not beat the
bf16 kernels there (kernels/layers/NOTES.md). Prefill gains too, where the projections are compute-bound.

Kernels by token count T (CUDA):
- T <= SLAB_MAX_TOKENS and weights of at most SLAB_MAX_WEIGHT_BYTES (QKV, O at batch 1-2): the slab GEMV
  (slab_gemv_triton: each program's whole weight slab loaded at once, fp32 FMAs on CUDA cores; x clamped to
  +-65504 as below, the same products);
- T <= 64 (decode): the split-K GEMV (fp8_gemv_triton): exact fp16 images of the e4m3 weights times x in
  fp16 (exact for bf16 x within +-65504, where it clamps; inputs here are RMS-normed or attention
  outputs), fp32 sums, block scale, bias, one rounding;
- T > 64, weight-only (the unembedding: decode batches above 64, many prompts ending in one step): the weight
  dequantized to a bf16 temporary (one Triton pass, exact) and cuBLAS: ~0.5 ms more than cuBLAS on bf16
  weights (836 vs 307 us at T = 64);
- T > 64 with fp8_activations (QKV, O): x per token per 128 channels to e4m3 (scale amax / 448), DeepGEMM's
  FP8 GEMM (1,316-1,350 TFLOP/s against cuBLAS bf16's 695-768 on these shapes, kernels/layers/NOTES.md), the
  bias added after the bf16 rounding. A request's numerics then depend on its step's token count (bf16
  activations at <= 64 tokens, FP8 above), as with `mxfp4_decode_max_tokens`: the price of the opt-in.
On CPU the forward is the twins, `reference` and `reference_w8a8`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.layers import gemv_tickets
from kernels.moe.fp8_quant import (BLOCK, FP8, align, dequantize_rows, dequantize_weight_blocks, padded,
                                   quantize_weight_blocks)

# rows of W quantized at a time: bounds the fp32 temporary (the 201088-row unembedding would need 2.4 GB)
_QUANT_ROWS = 64 * BLOCK
GEMV_MAX_TOKENS = 64  # the FP8 GEMV's limit: one [BLOCK_N, 128] x [128, BLOCK_T <= 64] dot per step
# The slab GEMV at 1-2 tokens (0: off, bench/decode_ab's fp8-dense-tc). At T = 4 it was slower than the tensor-core
# GEMV (QKV 13.3 vs 11.1 us); the unembedding (0.59 GB) streams at 3.9 TB/s on the tensor-core GEMV already, so
# only projections up to 64 MB take it (H200 2026-12-02, bench/results/gemv_slab_v1_h200.json).
SLAB_MAX_TOKENS = 2
SLAB_MAX_WEIGHT_BYTES = 64 << 20
FP16_MAX = 65504.0


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (fp8 [N, Kp], fp32 power-of-two scales [ceil(N/128), Kp/128])."""
    n, k = w.shape
    kp = padded(k)
    q = torch.empty(n, kp, dtype=FP8, device=w.device)
    s = torch.empty(align(n, BLOCK) // BLOCK, kp // BLOCK, dtype=torch.float32, device=w.device)
    for lo in range(0, n, _QUANT_ROWS):
        hi = min(n, lo + _QUANT_ROWS)
        qc, sc = quantize_weight_blocks(w[None, lo:hi], kp, pow2_scales=True)
        q[lo:hi], s[lo // BLOCK: align(hi, BLOCK) // BLOCK] = qc[0], sc[0]
    return q, s


def reference_w8a8(a_q: torch.Tensor, a_scales: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   n_in: int, dtype: torch.dtype) -> torch.Tensor:
    """The FP8-activation GEMM's twin: fp8 rows [T, Kp] with scales [T, Kp/128] times the dequantized weights,
    fp32, one rounding to `dtype`; no bias (the callers add it: reference.add_bias)."""
    x = dequantize_rows(a_q, a_scales)
    w = dequantize_weight_blocks(weight[None], weight_scale[None], weight.shape[1])[0]
    return (x @ w.T).to(dtype)


def reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
    """The twin: x (clamped to +-65504, as the GEMV's fp16 operand) times the dequantized weights in fp32,
    + bias, one rounding to x's dtype."""
    w = dequantize_weight_blocks(weight[None], weight_scale[None], x.shape[1])[0]
    y = x.float().clamp(-FP16_MAX, FP16_MAX) @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class Fp8Linear(nn.Module):
    """y = x @ W^T + b with W in FP8 128x128 blocks. `forward(x, with_bias=False)` skips the bias (the
    row-parallel O projection adds it on one rank only).

    fp8_activations=True (QKV and O with `dense_dtype="fp8_e4m3"`): calls of more than GEMV_MAX_TOKENS tokens
    quantize x per token per 128 channels (the MoE's formula) and run an FP8 x FP8 GEMM (DeepGEMM, else the
    Triton grouped GEMM with one group), bf16 out, then the bias (reference.add_bias). `gemm(rows)` is that GEMM
    alone on rows quantized by the caller's previous kernel (the norm), the bias left to the next one."""

    def __init__(self, in_features: int, out_features: int, bias: bool, bias_dtype: torch.dtype = torch.bfloat16,
                 device=None, fp8_activations: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fp8_activations = fp8_activations
        kp = padded(in_features)
        self.weight = nn.Parameter(torch.zeros(out_features, kp, dtype=FP8, device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(align(out_features, BLOCK) // BLOCK, kp // BLOCK,
                                                    dtype=torch.float32, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
                     if bias else None)
        self.register_buffer("gemv_tickets", gemv_tickets(out_features, device), persistent=False)
        self.m_indices = None  # the Triton FP8 GEMM's row -> group map (all 0), made on first use

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, fp8_activations: bool = False) -> "Fp8Linear":
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device, fp8_activations)
        out.weight.data, out.weight_scale.data = quantize_weight(w)
        if linear.bias is not None:
            out.bias.copy_(linear.bias)
        return out

    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] fp32: what the FP8 weight stands for (K padding cut)."""
        return dequantize_weight_blocks(self.weight[None], self.weight_scale[None], self.in_features)[0]

    @property
    def k_padded(self) -> int:
        return self.weight.shape[1]

    def quantizes(self, num_tokens: int) -> bool:
        """Whether a call of num_tokens tokens runs on FP8 activations (then `gemm` is its GEMM)."""
        return self.fp8_activations and num_tokens > GEMV_MAX_TOKENS

    def gemm(self, a) -> torch.Tensor:
        """rows (Fp8Rows, one group, [T, k_padded]) @ W^T -> [T, N] bf16, no bias."""
        t = a.rows_per_group
        if a.groups != 1 or a.data.shape[1] != self.k_padded:
            raise ValueError(f"Fp8Linear.gemm: rows must be one group of [T, {self.k_padded}], got "
                             f"{a.groups} x {tuple(a.data.shape)}")
        if not a.data.is_cuda:
            return reference_w8a8(a.data, a.scales_rows(), self.weight, self.weight_scale, self.in_features,
                                  self.bias.dtype if self.bias is not None else torch.bfloat16)
        out = torch.empty(t, self.out_features, dtype=torch.bfloat16, device=a.data.device)
        if t == 0:
            return out
        from kernels.moe import deep_gemm_ops

        if deep_gemm_ops.available():
            return deep_gemm_ops.gemm(a, self.weight, self.weight_scale, out)
        from kernels.moe import triton_grouped_gemm

        if self.m_indices is None or self.m_indices.numel() < t:  # every row expert 0: one group
            self.m_indices = torch.zeros(max(t, 4096), dtype=torch.int32, device=a.data.device)
        return triton_grouped_gemm.grouped_gemm(a, self.weight[None], self.weight_scale[None], out,
                                                self.m_indices[:t], masked=False)

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        bias = self.bias if with_bias else None
        if self.quantizes(x.shape[0]):
            from kernels.layers import quantize_rows
            from kernels.layers.reference import add_bias

            y = self.gemm(quantize_rows(x, self.k_padded))
            return y if bias is None else add_bias(y, bias)
        if not x.is_cuda:
            return reference(x, self.weight, self.weight_scale, bias)
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        from kernels.layers import fp8_gemv_triton

        if x.shape[0] <= SLAB_MAX_TOKENS and self.weight.numel() <= SLAB_MAX_WEIGHT_BYTES:
            from kernels.layers import slab_gemv_triton

            return slab_gemv_triton.slab_gemv(x, self.weight, self.weight_scale, bias, self.gemv_tickets)
        if x.shape[0] <= GEMV_MAX_TOKENS:
            return fp8_gemv_triton.fp8_gemv(x, self.weight, self.weight_scale, bias, self.gemv_tickets)
        w = fp8_gemv_triton.dequantize(self.weight, self.weight_scale, self.in_features, x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))

    def extra_repr(self) -> str:
        acts = ", fp8 activations above 64 tokens" if self.fp8_activations else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8 128x128{acts}")
