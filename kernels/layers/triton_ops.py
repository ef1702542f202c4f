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

from kernels import pdl
from kernels.pdl import pdl_prologue
from kernels.triton_rounding import round_to_bf16


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, n, eps,
                         stride_x, stride_delta, stride_sum, stride_out,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                         bias_ptr, q_ptr, sf_ptr, stride_q, sf_k_stride,
                         HAS_BIAS: tl.constexpr, QUANT: tl.constexpr, NUM_KB: tl.constexpr):
    # (the dense_dtype arguments come last, so that the shipped Triton manifests' argument indices stayed valid:
    # engine/triton_manifests, their "extended" note)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    # the norm's scale is no predecessor's output: loaded before the PDL wait, it arrives while the predecessor
    # finishes (with the decode front's router rows: b = 1 steps 20b 1.847 -> 1.798 ms, 120b 2.708 -> 2.641;
    # kernels/layers/NOTES.md)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    pdl_prologue(PDL)
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_delta + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:  # a projection's bias the GEMM left out: delta + bias rounded first, as the twin adds it
            d = (d + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        x = (x.to(tl.float32) + d).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
    t = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(t * t, axis=0) / n + eps)
    if QUANT:
        # the normed row (rounded to the activations' dtype, as the bf16 output would be) quantized per 128
        # channels for an FP8 GEMM: scale = max(amax, 1e-4) / 448, IEEE divisions (fp8_quant.quantize_rows);
        # columns n..NUM_KB*128 are zeros (K padding); scales MN-major (Fp8Rows)
        h = tl.reshape((t * inv * w).to(dtype).to(tl.float32), (BLOCK // 128, 128))
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(h), axis=1), 1e-4), 448.0)
        q = tl.math.div_rn(h, scale[:, None]).to(q_ptr.dtype.element_ty)
        kb = tl.arange(0, BLOCK // 128)
        col2 = kb[:, None] * 128 + tl.arange(0, 128)[None, :]
        tl.store(q_ptr + row * stride_q + col2, q, mask=(kb < NUM_KB)[:, None])
        tl.store(sf_ptr + row + kb * sf_k_stride, scale, mask=kb < NUM_KB)
    else:
        tl.store(out_ptr + row * stride_out + cols, (t * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 delta_bias: torch.Tensor | None = None, quant_out=None):
    """rms_norm(x) (delta None) or (x + delta, rms_norm(x + delta)), rows of x [T, D]. delta_bias [D]: added to
    delta first (rounded), a projection bias left out of its GEMM. quant_out (an Fp8Rows of one group, T rows,
    K >= D): the normed rows go there quantized per 128 channels instead of into a new tensor, which is then
    what is returned in the norm's place."""
    t, n = x.shape
    if x.stride(1) != 1 or (delta is not None and (delta.shape != x.shape or delta.stride(1) != 1)):
        raise ValueError(f"add_rms_norm needs [T, D] rows with unit stride; got x {tuple(x.shape)}"
                         + ("" if delta is None else f", delta {tuple(delta.shape)}"))
    if delta_bias is not None and (delta is None or delta_bias.shape != (n,)):
        raise ValueError(f"add_rms_norm: delta_bias needs a delta and shape [{n}]")
    if quant_out is not None and (quant_out.groups != 1 or quant_out.rows_per_group != t
                                  or quant_out.k_blocks * 128 < n or quant_out.data.stride(1) != 1):
        raise ValueError(f"add_rms_norm: quant_out must hold {t} rows of >= {n} channels in one group")
    out = torch.empty_like(x) if quant_out is None else quant_out
    s = torch.empty_like(x) if delta is not None else x
    if t:
        block = triton.next_power_of_2(n if quant_out is None else quant_out.k_blocks * 128)
        q, sf = (x, x) if quant_out is None else (quant_out.data, quant_out.scale_storage)
        _add_rms_norm_kernel[(t,)](
            x, delta if delta is not None else x, weight, s, x if quant_out is not None else out, n, eps,
            x.stride(0), delta.stride(0) if delta is not None else 0, s.stride(0),
            out.stride(0) if quant_out is None else 0,
            HAS_DELTA=delta is not None, BLOCK=block,
            bias_ptr=delta_bias if delta_bias is not None else x, q_ptr=q, sf_ptr=sf,
            stride_q=q.stride(0) if quant_out is not None else 0,
            sf_k_stride=quant_out.sf_k_stride if quant_out is not None else 0,
            HAS_BIAS=delta_bias is not None, QUANT=quant_out is not None,
            NUM_KB=quant_out.k_blocks if quant_out is not None else 1,
            num_warps=8 if block >= 4096 else 4, **pdl.launch(x))
    return out if delta is None else (s, out)


@triton.jit
def _round(v, dtype: tl.constexpr):
    """fp32 v rounded to `dtype` and back to fp32, as torch rounds each bf16 op (see kernels/triton_rounding.py)."""
    if dtype == tl.bfloat16:
        return round_to_bf16(v)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def _rotary_qkv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, num_tokens,
                       stride_t, stride_cos, num_heads, num_kv_heads, stride_cb, stride_ct, stride_ch,
                       HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, WRITE_CACHE: tl.constexpr,
                       V_OUT: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr,
                       bias_ptr, HAS_BIAS: tl.constexpr):  # (last: see _add_rms_norm_kernel)
    # heads [0, Hq) are q, [Hq, Hq + Hkv) k (both rotated), [Hq + Hkv, Hq + 2 Hkv) v (copied to the cache and,
    # with V_OUT, to contiguous rows); a program takes BLOCK_T tokens x BLOCK_H heads: [BLOCK_T, BLOCK_H, HALF].
    # HAS_BIAS: the projection's bias, which its GEMM left out, is added to every head first (rounded), and v
    # rows without a V_OUT destination are written back into qkv with it (v stays a view of qkv).
    token = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None, None]
    heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[None, :, None]
    d = tl.arange(0, HALF)[None, None, :]
    t_ok = token < num_tokens
    ok = t_ok & (heads < num_heads + (2 if WRITE_CACHE or V_OUT or HAS_BIAS else 1) * num_kv_heads)
    dtype = q_ptr.dtype.element_ty
    # cos / sin (gathered at the step's start) and the slots (a step input) come from kernels at least two back,
    # complete by now (kernels/pdl.py): loaded before the wait (b = 1 steps 20b 1.799 -> 1.784 ms, 120b 2.664 ->
    # 2.645; kernels/layers/NOTES.md). qkv is the predecessor's output: after it.
    c = _round(tl.load(cos_ptr + token * stride_cos + d, mask=t_ok, other=0.0), dtype)
    s = _round(tl.load(sin_ptr + token * stride_cos + d, mask=t_ok, other=0.0), dtype)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + token, mask=t_ok, other=-1)  # [BLOCK_T, 1, 1]
    pdl_prologue(PDL)
    src = qkv_ptr + token * stride_t + heads * (2 * HALF) + d
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = bias_ptr + heads * (2 * HALF) + d
        x1 = _round(x1 + tl.load(b, mask=ok, other=0.0).to(tl.float32), dtype)
        x2 = _round(x2 + tl.load(b + HALF, mask=ok, other=0.0).to(tl.float32), dtype)
    o1 = (_round(x1 * c, dtype) - _round(x2 * s, dtype)).to(dtype)
    o2 = (_round(x2 * c, dtype) + _round(x1 * s, dtype)).to(dtype)
    is_q = heads < num_heads
    is_k = ~is_q & (heads < num_heads + num_kv_heads)
    q_dst = q_ptr + (token * num_heads + heads) * (2 * HALF) + d
    k_dst = k_ptr + (token * num_kv_heads + heads - num_heads) * (2 * HALF) + d
    tl.store(q_dst, o1, mask=ok & is_q)
    tl.store(q_dst + HALF, o2, mask=ok & is_q)
    tl.store(k_dst, o1, mask=ok & is_k)
    tl.store(k_dst + HALF, o2, mask=ok & is_k)
    if V_OUT:
        v_dst = v_ptr + (token * num_kv_heads + heads - num_heads - num_kv_heads) * (2 * HALF) + d
        row_v = ok & ~is_q & ~is_k
        tl.store(v_dst, x1.to(dtype), mask=row_v)
        tl.store(v_dst + HALF, x2.to(dtype), mask=row_v)
    elif HAS_BIAS:
        row_v = ok & ~is_q & ~is_k
        tl.store(src, x1.to(dtype), mask=row_v)
        tl.store(src + HALF, x2.to(dtype), mask=row_v)
    if WRITE_CACHE:  # each token's k (rotated) and v rows into its paged-cache slot; slot -1: padding
        live = ok & (slot >= 0)
        page_row = (tl.maximum(slot, 0) // PAGE) * stride_cb + (tl.maximum(slot, 0) % PAGE) * stride_ct
        is_v = live & ~is_q & ~is_k
        kv_head = tl.where(is_k, heads - num_heads, heads - num_heads - num_kv_heads)
        dst = page_row + kv_head * stride_ch + d
        write_k = live & is_k
        tl.store(kc_ptr + dst, o1.to(kc_ptr.dtype.element_ty), mask=write_k)
        tl.store(kc_ptr + dst + HALF, o2.to(kc_ptr.dtype.element_ty), mask=write_k)
        tl.store(vc_ptr + dst, x1.to(vc_ptr.dtype.element_ty), mask=is_v)
        tl.store(vc_ptr + dst + HALF, x2.to(vc_ptr.dtype.element_ty), mask=is_v)


# Prompt-sized calls take ROTARY_BLOCK_T tokens per program (decode-sized ones one). H200, 2026-11-30, with
# the K/V write (bench/results/rotary_tiles_h200.log): 1 / 2 / 4 / 8 / 16 tokens per program 35.9 / 31.9 /
# 29.8 / 32.6 / 36.2 us at 4k tokens, 66.6 / 58.1 / 52.9 / 59.6 / 65.1 us at 8k. Module-level so
# bench.prefill_ab --variants rotary-tiles can switch it.
ROTARY_BLOCK_T = 4
ROTARY_TILED_FROM = 256


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
               head_dim: int, kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
               v_out: torch.Tensor | None = None, bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k rotated, v a view of qkv (bias [width]: added to every head first; qkv's v columns then hold v + bias).
    With kv_cache = (k_cache, v_cache [pages, PAGE, Hkv, Dh], slots [>=T]
    int64) the same launch also writes each token's k and v rows to the cache (kv_write.write_kv's job).
    q_out / k_out / v_out: contiguous [T, H, Dh] tensors q, k and v are written into (checked by the caller,
    kernels.layers.rotary_qkv); v_out makes v a copy instead of a view of qkv."""
    t, width = qkv.shape
    if width != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1 or head_dim % 2 \
            or head_dim & (head_dim - 1) or cos.shape != (t, head_dim // 2) or cos.stride() != sin.stride():
        raise ValueError(f"rotary_qkv: qkv {tuple(qkv.shape)} must be [T, (Hq + 2 Hkv) Dh] with a power-of-two Dh "
                         f"and cos/sin [T, Dh/2] (got {tuple(cos.shape)})")
    if bias is not None and (bias.shape != (width,) or not bias.is_contiguous()):
        raise ValueError(f"rotary_qkv: bias {tuple(bias.shape)} must be a contiguous [{width}] tensor")
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device) if q_out is None else q_out
    k = torch.empty(t, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device) if k_out is None else k_out
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(t, num_kv_heads, head_dim) if v_out is None else v_out
    write = kv_cache is not None
    if write:
        k_cache, v_cache, slots = kv_cache
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or k_cache.shape[2:] != (num_kv_heads, head_dim) \
                or slots.numel() < t:
            raise ValueError(f"rotary_qkv: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be "
                             f"[pages, page, {num_kv_heads}, {head_dim}] alike with >= {t} slots")
    else:
        k_cache = v_cache = slots = q  # unused pointers
    if t:
        block_h = 16
        block_t = ROTARY_BLOCK_T if t >= ROTARY_TILED_FROM else 1
        heads = num_heads + (2 if write or v_out is not None or bias is not None else 1) * num_kv_heads
        grid = (triton.cdiv(t, block_t), triton.cdiv(heads, block_h))
        _rotary_qkv_kernel[grid](qkv, cos, sin, q, k, v, k_cache, v_cache, slots, t, qkv.stride(0), cos.stride(0),
                                 num_heads, num_kv_heads, k_cache.stride(0) if write else 0,
                                 k_cache.stride(1) if write else 0, k_cache.stride(2) if write else 0,
                                 HALF=head_dim // 2, BLOCK_T=block_t, BLOCK_H=block_h, WRITE_CACHE=write,
                                 V_OUT=v_out is not None, PAGE=k_cache.shape[1] if write else 1,
                                 bias_ptr=qkv if bias is None else bias, HAS_BIAS=bias is not None, num_warps=4,
                                 **pdl.launch(qkv))
    return q, k, v
