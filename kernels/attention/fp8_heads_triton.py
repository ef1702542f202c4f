"""Per-head FP8 (e4m3) quantization of attention rows [T, H, D] for an FP8 prefill kernel: one fp32 scale per
head, amax / 448 over the head's T x D values, so each head uses e4m3's whole range. Two launches per tensor:
the heads' amax by atomic max over token blocks, then the scaled cast into contiguous rows. The twin is
kernels/attention/reference.quantize_heads_fp8."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
BLOCK_T = 64


@triton.jit
def _head_amax(x_ptr, amax_ptr, T, stride_t, stride_h, D: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    cols = tl.arange(0, D)
    ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_t + h * stride_h + cols[None, :]
    x = tl.load(ptrs, mask=rows[:, None] < T, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr + h, tl.max(tl.max(tl.abs(x), axis=1), axis=0))


@triton.jit
def _head_cast(x_ptr, amax_ptr, y_ptr, scale_ptr, T, stride_t, stride_h, H: tl.constexpr, D: tl.constexpr,
               BLOCK_T: tl.constexpr, FP8_MAX: tl.constexpr):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    scale = tl.div_rn(tl.maximum(tl.load(amax_ptr + h), 1e-12), FP8_MAX)  # IEEE, as the twin
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, D)
    mask = rows[:, None] < T
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_t + h * stride_h + cols[None, :], mask=mask, other=0.0)
    y = tl.div_rn(x.to(tl.float32), scale)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * (H * D) + h * D + cols[None, :], y.to(tl.float8e4nv), mask=mask)
    if pid_t == 0:
        tl.store(scale_ptr + h, scale)


def quantize_heads_fp8(x: torch.Tensor, out: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                       amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] (16-bit; rows and heads may be strided, D contiguous) -> (e4m3 [T, H, D] contiguous, fp32 [H]
    with x ~= out * scale[h]). `amax` (fp32 [H]) is scratch, zeroed here."""
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"expected [T, H, D] rows with a contiguous last dimension, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    t, h, d = x.shape
    if d & (d - 1):
        raise ValueError(f"head dim {d} is not a power of two")
    out = torch.empty(t, h, d, dtype=torch.float8_e4m3fn, device=x.device) if out is None else out
    scale = torch.empty(h, dtype=torch.float32, device=x.device) if scale is None else scale
    amax = torch.zeros(h, dtype=torch.float32, device=x.device) if amax is None else amax.zero_()
    grid = (triton.cdiv(max(t, 1), BLOCK_T), h)
    _head_amax[grid](x, amax, t, x.stride(0), x.stride(1), D=d, BLOCK_T=BLOCK_T)
    _head_cast[grid](x, amax, out, scale, t, x.stride(0), x.stride(1), H=h, D=d, BLOCK_T=BLOCK_T, FP8_MAX=E4M3_MAX)
    return out, scale
