"""Norms and rotary of the transformer blocks: Triton on CUDA tensors (fewer launches), the pure-torch
twins (reference.py) everywhere else. Both compute the same formulas; see the two modules."""

from __future__ import annotations

import torch

from kernels.layers import reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda and x.dim() == 2:
        from kernels.layers import triton_ops

        return triton_ops.add_rms_norm(x.contiguous(), None, weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)); delta_bias: a projection bias its GEMM left out, added to delta first."""
    if x.is_cuda and x.dim() == 2:
        from kernels.layers import triton_ops

        return triton_ops.add_rms_norm(x.contiguous(), delta.contiguous(), weight, eps, delta_bias)
    return reference.add_rms_norm(x, delta, weight, eps, delta_bias)


def rms_norm_fp8(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, k_padded: int):
    """The norm of x (+ delta) quantized for an FP8 GEMM: an Fp8Rows [T, k_padded] (per token per 128 channels,
    kernels/moe/fp8_quant.quantize_rows of the bf16 norm), with x + delta first when delta is given:
    (x + delta, rows). On CUDA one launch, the bf16 norm never written."""
    from kernels.moe.epilogues_triton import Fp8Rows

    if x.is_cuda and x.dim() == 2:
        from kernels.layers import triton_ops

        rows = Fp8Rows.empty(1, x.shape[0], k_padded, x.device)
        return triton_ops.add_rms_norm(x.contiguous(), None if delta is None else delta.contiguous(), weight, eps,
                                       quant_out=rows)
    if delta is None:
        return quantize_rows(reference.rms_norm(x, weight, eps), k_padded)
    s, h = reference.add_rms_norm(x, delta, weight, eps)
    return s, quantize_rows(h, k_padded)


def quantize_rows(x: torch.Tensor, k_padded: int):
    """x [T, K] -> Fp8Rows [T, k_padded]: per token per 128 channels, the MoE's activation formula
    (kernels/moe/fp8_quant.quantize_rows; on CUDA its Triton kernel, dispatch_quant, one row per token)."""
    from kernels.moe.epilogues_triton import Fp8Rows

    if x.is_cuda:
        from kernels.moe.epilogues_triton import dispatch_quant

        rows = Fp8Rows.empty(1, x.shape[0], k_padded, x.device)
        return dispatch_quant(x, torch.arange(x.shape[0], dtype=torch.int32, device=x.device), 1, rows)
    from kernels.moe.fp8_quant import quantize_rows as twin

    return Fp8Rows.from_rows(*twin(x, k_padded))


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
               head_dim: int, kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
               v_out: torch.Tensor | None = None, bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) [T, H, Dh] with q and k rotated; with kv_cache = (k_cache, v_cache, slot_mapping) also
    writes k and v into the paged cache (slot -1: skipped), on CUDA in the same launch. q_out / k_out /
    v_out: contiguous [T, H, Dh] tensors q, k, v are written into (and returned as). bias: the QKV
    projection's bias when its GEMM left it out, added (one rounding) before the rotary."""
    t = qkv.shape[0]
    for name, out, heads in (("q_out", q_out, num_heads), ("k_out", k_out, num_kv_heads), ("v_out", v_out, num_kv_heads)):
        if out is not None and (out.shape != (t, heads, head_dim) or not out.is_contiguous() or out.dtype != qkv.dtype):
            raise ValueError(f"rotary_qkv: {name} {tuple(out.shape)} {out.dtype} must be a contiguous "
                             f"[{t}, {heads}, {head_dim}] {qkv.dtype} tensor")
    if qkv.is_cuda:
        from kernels.layers import triton_ops

        if cos.stride(-1) != 1 or cos.stride() != sin.stride():  # row views of one table (RotaryEmbedding) go as they are
            cos, sin = cos.contiguous(), sin.contiguous()
        return triton_ops.rotary_qkv(qkv.contiguous(), cos, sin, num_heads,
                                     num_kv_heads, head_dim, kv_cache, q_out, k_out, v_out, bias)
    if bias is not None:
        qkv = reference.add_bias(qkv, bias)
    q, k, v = reference.rotary_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
    if kv_cache is not None:
        reference.write_kv(k, v, *kv_cache)
    q, k, v = (x if out is None else out.copy_(x) for x, out in ((q, q_out), (k, k_out), (v, v_out)))
    return q, k, v


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tickets: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x @ weight^T + bias. Decode-sized bf16 batches on CUDA (T <= 16, `tickets` given: the caller's
    gemv_triton.new_tickets) take the split-K GEMV; everything else torch's F.linear."""
    if tickets is not None and x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16:
        from kernels.layers import gemv_triton

        if 0 < x.shape[0] <= gemv_triton.GEMV_MAX_TOKENS:
            return gemv_triton.gemv(x, weight, bias, tickets)
    return torch.nn.functional.linear(x, weight, bias)


# The GEMV's smallest N block; its tickets are sized for it (here, so that building a model does not
# import Triton: gemv_triton reads it from this module).
GEMV_MIN_BLOCK_N = 16


def gemv_tickets(n: int, device=None) -> torch.Tensor:
    """The per-block tickets (zero between calls) `linear` needs for a projection with N outputs."""
    return torch.zeros(-(-n // GEMV_MIN_BLOCK_N), dtype=torch.int32, device=device)


__all__ = ["GEMV_MIN_BLOCK_N", "add_rms_norm", "gemv_tickets", "linear", "quantize_rows", "reference", "rms_norm",
           "rms_norm_fp8", "rotary_qkv"]
