"""Dense projections with FP8 weights, weight-only: the unembedding with `lm_head_dtype="fp8_e4m3"` (opt-in).

The checkpoints hold the dense projections in bf16; an Fp8Linear rounds one once at load to
float8_e4m3 with one power-of-two fp32 scale per 128x128 block (K zero-padded to a multiple of 128).
Every FP8 weight times its power-of-two scale is exactly a bf16 value, so the model computed is the bf16
model with its dense weights rounded to FP8 (~2^-5 relative, RMS), nothing else: activations are never
quantized, and every token count takes the same numerics (up to fp32 summation order). Half the bytes of
the bf16 weights; the default stays bf16 (the model then matches the reference) and this is a choice the
operator makes. Only the unembedding uses it: QKV and O are too small for the FP8 GEMV to beat the bf16
kernels (kernels/layers/NOTES.md).

Kernels by token count T (CUDA):
- T <= 64 (decode): the split-K GEMV (fp8_gemv_triton): exact fp16 images of the e4m3 weights times x in
  fp16 (exact for bf16 x within +-65504, where it clamps; inputs here are RMS-normed or attention
  outputs), fp32 sums, block scale, bias, one rounding;
- T > 64 (decode batches above 64, many prompts ending in one step): the weight dequantized to a bf16
  temporary (one Triton pass, exact) and cuBLAS: for the unembedding ~0.5 ms more than cuBLAS on bf16
  weights (836 vs 307 us at T = 64). An FP8-activation GEMM (DeepGEMM) would be faster, but quantizing
  activations only above some batch size would make a request's numerics depend on its batch mates.
On CPU the forward is the twin, `reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.layers import gemv_tickets
from kernels.moe.fp8_quant import BLOCK, FP8, align, dequantize_weight_blocks, padded, quantize_weight_blocks

# rows of W quantized at a time: bounds the fp32 temporary (the 201088-row unembedding would need 2.4 GB)
_QUANT_ROWS = 64 * BLOCK
GEMV_MAX_TOKENS = 64  # the FP8 GEMV's limit: one [BLOCK_N, 128] x [128, BLOCK_T <= 64] dot per step
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
    row-parallel O projection adds it on one rank only)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, bias_dtype: torch.dtype = torch.bfloat16,
                 device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        kp = padded(in_features)
        self.weight = nn.Parameter(torch.zeros(out_features, kp, dtype=FP8, device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(align(out_features, BLOCK) // BLOCK, kp // BLOCK,
                                                    dtype=torch.float32, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
                     if bias else None)
        self.register_buffer("gemv_tickets", gemv_tickets(out_features, device), persistent=False)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
        out.weight.data, out.weight_scale.data = quantize_weight(w)
        if linear.bias is not None:
            out.bias.copy_(linear.bias)
        return out

    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] fp32: what the FP8 weight stands for (K padding cut)."""
        return dequantize_weight_blocks(self.weight[None], self.weight_scale[None], self.in_features)[0]

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        bias = self.bias if with_bias else None
        if not x.is_cuda:
            return reference(x, self.weight, self.weight_scale, bias)
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        from kernels.layers import fp8_gemv_triton

        if x.shape[0] <= GEMV_MAX_TOKENS:
            return fp8_gemv_triton.fp8_gemv(x, self.weight, self.weight_scale, bias, self.gemv_tickets)
        w = fp8_gemv_triton.dequantize(self.weight, self.weight_scale, self.in_features, x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8 128x128"
