"""Write this step's K/V rows into the paged cache, in one Triton launch for both tensors.

The twin is TorchAttentionBackend.write_kv (index_copy_ at slot_mapping). A negative slot marks a
padding token (a CUDA graph captured for a larger batch than the step has) and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,  # new k/v [T, Hkv, D], unit stride in D
    stride_cb, stride_ct, stride_ch,  # cache [num_blocks, PAGE, Hkv, D]
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM)
    ok = (h[:, None] < NUM_KV_HEADS) & (slot >= 0)
    slot = tl.maximum(slot, 0)  # keeps the masked-off address in range
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct + h[:, None] * stride_ch + d[None, :]
    src = token.to(tl.int64)
    k = tl.load(k_ptr + src * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok)
    v = tl.load(v_ptr + src * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, page, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [>=T]; page * page_size + offset, or -1 to skip
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("write_kv needs unit stride in head_dim and K/V caches of identical layout")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1], num_warps=2,
    )
