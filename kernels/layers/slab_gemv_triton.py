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
from kernels.pdl import pdl_prologue
from kernels.triton_rounding import round_to_bf16

MAX_TOKENS = 4  # the kernel's limit (BLOCK_T unrolled per token); fp8_linear.SLAB_MAX_TOKENS is where it pays
QBLOCK = 128  # FP8 scale block along K and N; also the slab's inner K extent
# The sweep's best at T = 1 and 2 for both shapes, QKV / O 7.1 / 5.8 us at T = 1 (bench/gemv_slab, H200 2026-12-02,
# bench/results/gemv_slab_v1_h200.json): 64 rows x 256 K per program, 960 / 720 programs
DEFAULT_CONFIG = dict(BLOCK_N=64, K_SPLIT=256, num_warps=4, weights_first=True)


@triton.jit
def _slab_gemv_kernel(x_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, partial_ptr, tickets_ptr, num_tokens, n, k_in, k_w,
                      stride_x, stride_w, stride_sw, stride_y, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, NKB: tl.constexpr, SPLIT_K: tl.constexpr,
                      WEIGHTS_FIRST: tl.constexpr, PDL: tl.constexpr,
                      # the rotary tail (ROTARY: a QKV projection, one head per program row block; see rotary_tail)
                      cos_ptr, sin_ptr, stride_cos, q_ptr, k_ptr, kc_ptr, vc_ptr, slot_ptr, num_heads, num_kv_heads,
                      stride_cb, stride_ct, stride_ch, ROTARY: tl.constexpr, WRITE_CACHE: tl.constexpr,
                      PAGE: tl.constexpr):
    nb, split = tl.program_id(0), tl.program_id(1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = split * NKB + tl.arange(0, NKB)  # 128-wide K blocks of this split
    offs_k = offs_kb[:, None] * 128 + tl.arange(0, 128)[None, :]  # [NKB, 128]
    n_ok = offs_n < n
    w_ptrs = w_ptr + offs_n[:, None, None].to(tl.int64) * stride_w + offs_k[None, :, :]
    w_ok = n_ok[:, None, None] & (offs_k < k_w)[None, :, :]
    if WEIGHTS_FIRST:
        w = tl.load(w_ptrs, mask=w_ok, other=0.0)
        pdl_prologue(PDL)
    else:
        pdl_prologue(PDL)
        w = tl.load(w_ptrs, mask=w_ok, other=0.0)
    w = w.to(tl.float32)
    if HAS_SCALE:  # BLOCK_N divides 128: one scale row per program, one scale per K block
        s = tl.load(sw_ptr + (nb * BLOCK_N // 128) * stride_sw + offs_kb, mask=offs_kb * 128 < k_w, other=0.0)
    offs_t = tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for t in tl.static_range(BLOCK_T):
        k_t = tl.where(t < num_tokens, k_in, 0)  # rows past num_tokens read as zeros
        xt = tl.load(x_ptr + t * stride_x + offs_k, mask=offs_k < k_t, other=0.0).to(tl.float32)
        if HAS_SCALE:
            xt = tl.minimum(tl.maximum(xt, -65504.0), 65504.0) * s[:, None]
        yt = tl.sum(tl.sum(w * xt[None, :, :], axis=2), axis=1)
        acc = tl.where(offs_t[None, :] == t, yt[:, None], acc)
    if ROTARY:
        rotary_tail(acc, partial_ptr, tickets_ptr, b_ptr, y_ptr, nb, split, offs_n, offs_t, n, num_tokens, stride_y,
                    cos_ptr, sin_ptr, stride_cos, q_ptr, k_ptr, kc_ptr, vc_ptr, slot_ptr, num_heads, num_kv_heads,
                    stride_cb, stride_ct, stride_ch, HAS_BIAS, BLOCK_N, BLOCK_T, SPLIT_K, WRITE_CACHE, PAGE)
    else:
        finish_split_k(acc, partial_ptr, tickets_ptr, b_ptr, y_ptr, nb, split, offs_n, offs_t, n, num_tokens,
                       stride_y, HAS_BIAS, BLOCK_N, BLOCK_T, SPLIT_K)


@triton.jit
def _round(v, dtype: tl.constexpr):
    """fp32 v rounded to `dtype` and back to fp32, as torch rounds each bf16 op (the rotary kernel's rounding)."""
    if dtype == tl.bfloat16:
        return round_to_bf16(v)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def rotary_tail(acc, partial_ptr, tickets_ptr, b_ptr, y_ptr, nb, split, offs_n, offs_t, n, num_tokens, stride_y,
                cos_ptr, sin_ptr, stride_cos, q_ptr, k_ptr, kc_ptr, vc_ptr, slot_ptr, num_heads, num_kv_heads,
                stride_cb, stride_ct, stride_ch, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                SPLIT_K: tl.constexpr, WRITE_CACHE: tl.constexpr, PAGE: tl.constexpr):
    """finish_split_k for a QKV projection whose N blocks are its heads (BLOCK_N = head_dim), with the rotary
    kernel's work (triton_ops._rotary_qkv_kernel, at its decode shape) done by the program that sums the head:
    it reads the partials as the head's two halves, stores y (= qkv, unrotated, as finish_split_k does: v stays a
    view of it), rotates q and k heads into q [T, Hq, Dh] and k [T, Hkv, Dh] with the rotary kernel's roundings,
    and with WRITE_CACHE writes k and v rows into the paged cache at their slots (slot -1: none). One launch
    instead of two, and no reload of qkv; the results bitwise the two kernels'."""
    tl.store(partial_ptr + offs_n[:, None] * BLOCK_T + offs_t[None, :] + split * n * BLOCK_T, acc,
             mask=(offs_n < n)[:, None])
    tl.debug_barrier()  # every thread's partials stored before the one thread taking the ticket releases them
    ticket = tl.atomic_add(tickets_ptr + nb, 1, sem="acq_rel")
    if ticket == SPLIT_K - 1:
        tl.store(tickets_ptr + nb, 0)
        HALF: tl.constexpr = BLOCK_N // 2
        d = tl.arange(0, HALF)[:, None]  # [HALF, 1]
        lo = nb * BLOCK_N + d
        tok = offs_t[None, :]  # [1, BLOCK_T]
        ok = (tok < num_tokens) & (lo < n)
        x1 = tl.zeros([HALF, BLOCK_T], dtype=tl.float32)
        x2 = tl.zeros([HALF, BLOCK_T], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # fixed order, as finish_split_k
            part = partial_ptr + s * n * BLOCK_T + tok
            x1 += tl.load(part + lo * BLOCK_T, mask=ok, other=0.0, cache_modifier=".cg")
            x2 += tl.load(part + (lo + HALF) * BLOCK_T, mask=ok, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            x1 += tl.load(b_ptr + lo, mask=lo < n, other=0.0).to(tl.float32)
            x2 += tl.load(b_ptr + lo + HALF, mask=lo < n, other=0.0).to(tl.float32)
        dtype = y_ptr.dtype.element_ty
        y1, y2 = x1.to(dtype), x2.to(dtype)
        y_row = y_ptr + tok * stride_y + lo
        tl.store(y_row, y1, mask=ok)
        tl.store(y_row + HALF, y2, mask=ok)
        head = nb
        tok64 = tok.to(tl.int64)
        if WRITE_CACHE:
            slot = tl.load(slot_ptr + tok64, mask=tok < num_tokens, other=-1)  # [1, BLOCK_T]
            live = ok & (slot >= 0)
            page_row = (tl.maximum(slot, 0) // PAGE) * stride_cb + (tl.maximum(slot, 0) % PAGE) * stride_ct
        if head < num_heads + num_kv_heads:  # q or k: rotated
            c = _round(tl.load(cos_ptr + tok64 * stride_cos + d, mask=ok, other=0.0), dtype)
            sn = _round(tl.load(sin_ptr + tok64 * stride_cos + d, mask=ok, other=0.0), dtype)
            a1, a2 = y1.to(tl.float32), y2.to(tl.float32)
            o1 = (_round(a1 * c, dtype) - _round(a2 * sn, dtype)).to(dtype)
            o2 = (_round(a2 * c, dtype) + _round(a1 * sn, dtype)).to(dtype)
            if head < num_heads:
                dst = q_ptr + (tok64 * num_heads + head) * BLOCK_N + d
                tl.store(dst, o1, mask=ok)
                tl.store(dst + HALF, o2, mask=ok)
            else:
                dst = k_ptr + (tok64 * num_kv_heads + head - num_heads) * BLOCK_N + d
                tl.store(dst, o1, mask=ok)
                tl.store(dst + HALF, o2, mask=ok)
                if WRITE_CACHE:
                    row = kc_ptr + page_row + (head - num_heads) * stride_ch + d
                    tl.store(row, o1.to(kc_ptr.dtype.element_ty), mask=live)
                    tl.store(row + HALF, o2.to(kc_ptr.dtype.element_ty), mask=live)
        elif WRITE_CACHE:  # v: as it is
            row = vc_ptr + page_row + (head - num_heads - num_kv_heads) * stride_ch + d
            tl.store(row, y1.to(tl.float32).to(vc_ptr.dtype.element_ty), mask=live)
            tl.store(row + HALF, y2.to(tl.float32).to(vc_ptr.dtype.element_ty), mask=live)


def slab_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, bias: torch.Tensor | None,
              tickets: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [T, K] (T <= 4) @ W^T + bias [N] -> [T, N] in x's dtype. W: float8_e4m3 [N, Kp] (K padded to 128s, K <=
    Kp) with weight_scale [ceil(N/128), Kp/128], or bf16/fp16/fp32 [N, K] with weight_scale None."""
    return _launch(x, weight, weight_scale, bias, tickets, dict(DEFAULT_CONFIG, **(config or {})), None)


def slab_qkv_rotary(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, bias: torch.Tensor | None,
                    tickets: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                    head_dim: int, kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The QKV projection and its rotary in one launch (`rotary_tail`): (q [T, Hq, Dh], k [T, Hkv, Dh] rotated,
    v [T, Hkv, Dh] a view of the projection's output), what slab_gemv then triton_ops.rotary_qkv(qkv, cos, sin, ...,
    kv_cache) return, bit for bit; with kv_cache = (k_cache, v_cache [pages, PAGE, Hkv, Dh], slots [>= T]) k and v
    are also written to the cache. Needs one head per N block (BLOCK_N = head_dim) and more than one K split."""
    t = x.shape[0]
    cfg = dict(DEFAULT_CONFIG, **(config or {}), BLOCK_N=head_dim)
    n = weight.shape[0]
    if n != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2 or head_dim & (head_dim - 1) \
            or 128 % head_dim or cos.shape != (t, head_dim // 2) or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError(f"slab_qkv_rotary: weight {tuple(weight.shape)} must be [(Hq + 2 Hkv) Dh, Kp] with a power-of-two"
                         f" Dh dividing 128 and cos/sin [T, Dh/2] row views alike (got {tuple(cos.shape)})")
    q = torch.empty(t, num_heads, head_dim, dtype=x.dtype, device=x.device)
    k = torch.empty(t, num_kv_heads, head_dim, dtype=x.dtype, device=x.device)
    if kv_cache is not None:
        k_cache, v_cache, slots = kv_cache
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 \
                or k_cache.shape[2:] != (num_kv_heads, head_dim) or slots.numel() < t:
            raise ValueError(f"slab_qkv_rotary: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be "
                             f"[pages, page, {num_kv_heads}, {head_dim}] alike with >= {t} slots")
        cache = dict(kc_ptr=k_cache, vc_ptr=v_cache, slot_ptr=slots, stride_cb=k_cache.stride(0),
                     stride_ct=k_cache.stride(1), stride_ch=k_cache.stride(2), WRITE_CACHE=True, PAGE=k_cache.shape[1])
    else:
        cache = dict(kc_ptr=q, vc_ptr=q, slot_ptr=q, stride_cb=0, stride_ct=0, stride_ch=0, WRITE_CACHE=False, PAGE=1)
    rot = dict(cos_ptr=cos, sin_ptr=sin, stride_cos=cos.stride(0), q_ptr=q, k_ptr=k, num_heads=num_heads,
               num_kv_heads=num_kv_heads, ROTARY=True, **cache)
    y = _launch(x, weight, weight_scale, bias, tickets, cfg, rot)
    v = y[:, (num_heads + num_kv_heads) * head_dim:].view(t, num_kv_heads, head_dim)
    return q, k, v


def _launch(x, weight, weight_scale, bias, tickets, cfg: dict, rotary: dict | None) -> torch.Tensor:
    t, k = x.shape
    n, kw = weight.shape
    fp8 = weight_scale is not None
    ok = 0 < t <= MAX_TOKENS and k <= kw and (bias is None or bias.shape == (n,)) \
        and tickets.numel() >= triton.cdiv(n, GEMV_MIN_BLOCK_N) and cfg["BLOCK_N"] >= GEMV_MIN_BLOCK_N \
        and cfg["K_SPLIT"] % QBLOCK == 0 and triton.next_power_of_2(cfg["K_SPLIT"] // QBLOCK) == cfg["K_SPLIT"] // QBLOCK
    if fp8:
        ok = ok and kw % QBLOCK == 0 and weight_scale.shape == (triton.cdiv(n, QBLOCK), kw // QBLOCK) \
            and QBLOCK % cfg["BLOCK_N"] == 0
    else:
        ok = ok and kw == k
    splits = triton.cdiv(kw, cfg["K_SPLIT"])
    if rotary is not None:
        ok = ok and splits > 1 and n % cfg["BLOCK_N"] == 0
    if not ok:
        raise ValueError(f"slab_gemv: x {tuple(x.shape)} (1..{MAX_TOKENS} rows), weight {tuple(weight.shape)} "
                         f"{weight.dtype}, scales {None if weight_scale is None else tuple(weight_scale.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)}, {tickets.numel()} tickets, {cfg}"
                         f"{'' if rotary is None else ', a rotary tail (needs > 1 K split)'}")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    nkb = cfg["K_SPLIT"] // QBLOCK
    block_t = triton.next_power_of_2(t)
    partial = torch.empty(splits if splits > 1 else 0, n, block_t, dtype=torch.float32, device=x.device)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if rotary is None:
        rotary = dict(cos_ptr=y, sin_ptr=y, stride_cos=0, q_ptr=y, k_ptr=y, kc_ptr=y, vc_ptr=y, slot_ptr=y, num_heads=0,
                      num_kv_heads=0, stride_cb=0, stride_ct=0, stride_ch=0, ROTARY=False, WRITE_CACHE=False, PAGE=1)
    _slab_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), splits)](
        x, weight, weight_scale if fp8 else weight, bias if bias is not None else weight, y, partial, tickets, t, n, k,
        kw, x.stride(0), weight.stride(0), weight_scale.stride(0) if fp8 else 0, y.stride(0), HAS_SCALE=fp8,
        HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_N=cfg["BLOCK_N"], NKB=nkb, SPLIT_K=splits,
        WEIGHTS_FIRST=cfg["weights_first"], num_warps=cfg["num_warps"], **rotary, **pdl.launch(x))
    return y
