"""Triton versions of kernels/layers/reference.py: one launch each where torch takes 8 to 18.

At decode sizes every torch elementwise op is a ~2 us launch: RMSNorm alone was 8 kernels and the
two rotaries 18 per layer (bench/results/e2e_h200.json, 2026-11-29: 192 elementwise launches per
20b decode step, ~50 kernels per layer in all). Numerics follow the twins: fp32 norm statistics;
the residual add and every rotary product/sum rounded to the activations' dtype like torch's ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_rounding import round_to_bf16


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, n, eps,
                         stride_x, stride_delta, stride_sum, stride_out,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_delta + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
    t = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(t * t, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (t * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """rms_norm(x) (delta None) or (x + delta, rms_norm(x + delta)), rows of x [T, D]."""
    t, n = x.shape
    if x.stride(1) != 1 or (delta is not None and (delta.shape != x.shape or delta.stride(1) != 1)):
        raise ValueError(f"add_rms_norm needs [T, D] rows with unit stride; got x {tuple(x.shape)}"
                         + ("" if delta is None else f", delta {tuple(delta.shape)}"))
    out = torch.empty_like(x)
    s = torch.empty_like(x) if delta is not None else x
    if t:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(t,)](
            x, delta if delta is not None else x, weight, s, out, n, eps,
            x.stride(0), delta.stride(0) if delta is not None else 0, s.stride(0), out.stride(0),
            HAS_DELTA=delta is not None, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out if delta is None else (s, out)


@triton.jit
def _round(v, dtype: tl.constexpr):
    """fp32 v rounded to `dtype` and back to fp32, as torch rounds each bf16 op (see kernels/triton_rounding.py)."""
    if dtype == tl.bfloat16:
        return round_to_bf16(v)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def _rotary_qkv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_t, stride_cos, num_heads, num_kv_heads,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # over the Hq + Hkv rotated heads
    d = tl.arange(0, HALF)
    ok = heads[:, None] < num_heads + num_kv_heads
    dtype = q_ptr.dtype.element_ty
    c = _round(tl.load(cos_ptr + token * stride_cos + d), dtype)[None, :]
    s = _round(tl.load(sin_ptr + token * stride_cos + d), dtype)[None, :]
    src = qkv_ptr + token * stride_t + heads[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    o1 = (_round(x1 * c, dtype) - _round(x2 * s, dtype)).to(dtype)
    o2 = (_round(x2 * c, dtype) + _round(x1 * s, dtype)).to(dtype)
    is_q = heads[:, None] < num_heads
    q_dst = q_ptr + (token * num_heads + heads[:, None]) * (2 * HALF) + d[None, :]
    k_dst = k_ptr + (token * num_kv_heads + heads[:, None] - num_heads) * (2 * HALF) + d[None, :]
    tl.store(q_dst, o1, mask=ok & is_q)
    tl.store(q_dst + HALF, o2, mask=ok & is_q)
    tl.store(k_dst, o1, mask=ok & ~is_q)
    tl.store(k_dst + HALF, o2, mask=ok & ~is_q)


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, width = qkv.shape
    if width != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1 or head_dim % 2 \
            or head_dim & (head_dim - 1) or cos.shape != (t, head_dim // 2) or cos.stride() != sin.stride():
        raise ValueError(f"rotary_qkv: qkv {tuple(qkv.shape)} must be [T, (Hq + 2 Hkv) Dh] with a power-of-two Dh "
                         f"and cos/sin [T, Dh/2] (got {tuple(cos.shape)})")
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(t, num_kv_heads, head_dim)
    if t:
        block_h = 16
        grid = (t, triton.cdiv(num_heads + num_kv_heads, block_h))
        _rotary_qkv_kernel[grid](qkv, cos, sin, q, k, qkv.stride(0), cos.stride(0), num_heads, num_kv_heads,
                                 HALF=head_dim // 2, BLOCK_H=block_h, num_warps=4)
    return q, k, v
