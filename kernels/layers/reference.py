"""Pure-torch RMSNorm (with the residual add) and rotary: the CPU path and the Triton kernels' twins.

These are the model's own formulas (OpenAI's reference does the same): RMSNorm in fp32, cast back;
rotary over non-interleaved halves with cos/sin cast to the activations' dtype first, every product
and sum rounded to that dtype as torch's bf16 ops round them.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    t = x.float()
    t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
    return (t * weight).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual add of one block and the next block's norm. delta_bias:
    a projection bias its GEMM left out, added to delta first (one rounding)."""
    if delta_bias is not None:
        delta = add_bias(delta, delta_bias)
    s = x + delta
    return s, rms_norm(s, weight, eps)


def add_bias(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y + bias in fp32, rounded once to y's dtype: a bias added after a GEMM that rounded its output."""
    return (y.float() + bias.float()).to(y.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, Dh]; cos/sin [T, Dh/2]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused QKV projection [T, (Hq + 2 Hkv) Dh] and rotate q and k.
    Returns q [T, Hq, Dh], k [T, Hkv, Dh] (rotated) and v [T, Hkv, Dh]."""
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = _rotate(q.reshape(t, num_heads, head_dim), cos, sin)
    k = _rotate(k.reshape(t, num_kv_heads, head_dim), cos, sin)
    return q, k, v.reshape(t, num_kv_heads, head_dim)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [T, Hkv, Dh] into the paged caches [pages, PAGE, Hkv, Dh] at slots[:T] (-1: skipped)."""
    t = k.shape[0]
    slots = slots[:t].long()
    keep = slots >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slots[keep]] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots[keep]] = v[keep].to(v_cache.dtype)
