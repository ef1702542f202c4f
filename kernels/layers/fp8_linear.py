"""Dense projections with FP8 weights (opt-in: `dense_weight_dtype="fp8_e4m3"`), the scheme of the MoE experts.

The checkpoints hold QKV, O and the unembedding in bf16; with this option they are quantized once at
load to float8_e4m3 with one fp32 scale per 128x128 block (amax / 448, not rounded to a power of two:
these weights are not MXFP4 values), K zero-padded to a multiple of 128. Half the bytes of the bf16
weights, which at batch 1 decode are half of everything the step reads; the price is FP8 rounding in
every projection, so the default stays bf16 (the model then matches the reference) and this is a
choice the operator makes.

Two kernels, two numerics, by token count T:
- T <= 16 (decode): weight-only. The split-K GEMV (fp8_gemv_triton) multiplies the exact fp16 image of
  each e4m3 weight with x converted to fp16 (clamped to +-65504: inputs here are RMS-normed or attention
  outputs, far inside that); twin `reference_weight_only`.
- T > 16 (prefill, large decode batches): x quantized per token per 128 channels by the MoE's
  dispatch_quant, then DeepGEMM's dense FP8 GEMM (our Triton grouped GEMM with one group where DeepGEMM
  is absent; both 1.5-1.75x cuBLAS bf16 at T = 4096, kernels/moe/NOTES.md), + bias; twin `reference_w8a8`.
On CPU the forward is the twin of the path the GPU would take.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.layers import gemv_tickets
from kernels.moe.fp8_quant import BLOCK, FP8, align, dequantize_rows, dequantize_weight_blocks, padded, \
    quantize_rows, quantize_weight_blocks

# rows of W quantized at a time: bounds the fp32 temporary (the 201088-row unembedding would need 2.4 GB)
_QUANT_ROWS = 64 * BLOCK


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (fp8 [N, Kp], fp32 scales [ceil(N/128), Kp/128]); amax scales (no power-of-two rounding)."""
    n, k = w.shape
    kp = padded(k)
    q = torch.empty(n, kp, dtype=FP8, device=w.device)
    s = torch.empty(align(n, BLOCK) // BLOCK, kp // BLOCK, dtype=torch.float32, device=w.device)
    for lo in range(0, n, _QUANT_ROWS):
        hi = min(n, lo + _QUANT_ROWS)
        qc, sc = quantize_weight_blocks(w[None, lo:hi], kp, pow2_scales=False)
        q[lo:hi], s[lo // BLOCK: align(hi, BLOCK) // BLOCK] = qc[0], sc[0]
    return q, s


FP16_MAX = 65504.0


def reference_weight_only(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """Twin of the T <= 16 GEMV: x through fp16 (clamped), dequantized weights, fp32 matmul, + bias, one rounding."""
    xh = x.float().clamp(-FP16_MAX, FP16_MAX).to(torch.float16).float()
    w = dequantize_weight_blocks(weight[None], weight_scale[None], x.shape[1])[0]
    y = xh @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def reference_w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    """Twin of the T > 16 path: x quantized per token per 128 channels, both operands dequantized, fp32
    matmul, + bias, one rounding to x's dtype."""
    q, s = quantize_rows(x.float(), weight.shape[1])
    w = dequantize_weight_blocks(weight[None], weight_scale[None])[0]
    y = dequantize_rows(q, s) @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


GEMV_MAX_TOKENS = 16  # = fp8_gemv_triton.GEMV_MAX_TOKENS (not imported here: no Triton on the CPU path)


def reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
    """The twin of whichever path Fp8Linear takes for x's token count."""
    fn = reference_weight_only if x.shape[0] <= GEMV_MAX_TOKENS else reference_w8a8
    return fn(x, weight, weight_scale, bias)


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
        q, s = quantize_weight(w)
        out.weight.data, out.weight_scale.data = q, s
        if linear.bias is not None:
            out.bias.copy_(linear.bias)
        return out

    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] fp32: what the FP8 weight stands for (K padding cut)."""
        return dequantize_weight_blocks(self.weight[None], self.weight_scale[None], self.in_features)[0]

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        bias = self.bias if with_bias else None
        t = x.shape[0]
        if not x.is_cuda:
            return reference(x, self.weight, self.weight_scale, bias)
        if t == 0:
            return x.new_empty(0, self.out_features)
        from kernels.layers import fp8_gemv_triton

        if t <= GEMV_MAX_TOKENS:
            return fp8_gemv_triton.fp8_gemv(x, self.weight, self.weight_scale, bias, self.gemv_tickets)
        return self._gemm(x, bias)

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from kernels.moe import deep_gemm_ops, epilogues_triton, triton_grouped_gemm
        from kernels.moe.epilogues_triton import Fp8Rows

        t = x.shape[0]
        a = Fp8Rows.empty(1, t, self.weight.shape[1], x.device)
        rows = torch.arange(t, dtype=torch.int32, device=x.device)  # token t -> GEMM row t
        epilogues_triton.dispatch_quant(x, rows, 1, a)
        y = torch.empty(t, self.out_features, dtype=torch.bfloat16, device=x.device)
        if deep_gemm_ops.available():
            deep_gemm_ops.gemm(a, self.weight, self.weight_scale, y)
        else:
            triton_grouped_gemm.grouped_gemm(a, self.weight[None], self.weight_scale[None], y,
                                             torch.zeros(t, dtype=torch.int32, device=x.device), masked=False)
        if bias is not None:
            y += bias
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8 128x128"
