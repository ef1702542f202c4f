"""Causal sink attention for whole prompts (no cached history) through torch's fused SDPA kernels.

gpt-oss's sink is one learned logit per head that joins each query's softmax denominator and brings no
value. With a kernel's plain causal softmax, Z = sum_j e^{s_j}, out = sum_j e^{s_j} v_j / Z, lse = log Z:

    out_sink = sum_j e^{s_j} v_j / (Z + e^{sink}) = out * Z / (Z + e^{sink}) = out * sigmoid(lse - sink)

so any fused kernel that returns its log-sum-exp gives sink attention with one elementwise pass after it
(`sink_rescale`). Kernels (`backend`):
  "cudnn"  torch's cuDNN SDPA (a Hopper warp-specialized kernel), K/V repeated to the query heads (the
           private op takes equal head counts; so does the CPU one)
  "flash"  torch's FlashAttention-2 kernel (grouped heads natively)
  "cpu"    torch's CPU flash kernel: the tests' path for the same rescale

Only prompts without history (every key is one of the step's new rows, contiguous k / v) would qualify.
A probe, not on the engine's path: on the H200 both were slower than FlashInfer's fa3 with its native sink
(cuDNN 0.58-0.94x, FA2 0.64-0.81x of its speed at 1k-16k tokens; kernels/attention/NOTES.md). `python -m bench.attention
--prefill-only --dense` re-runs the comparison.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BACKENDS = ("cudnn", "flash", "cpu")


def _as_bhsd(x: torch.Tensor) -> torch.Tensor:
    """[N, H, D] (rows of any stride, last dim contiguous) -> a [1, H, N, D] view."""
    return x.unsqueeze(0).transpose(1, 2)


def causal_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [N, Hq, D] in q's dtype, lse [Hq, N] fp32, natural log) of plain causal attention, no sink."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    n, hq, d = q.shape
    hkv = k.shape[1]
    if backend != "flash" and hkv != hq:  # grouped heads: repeat K/V to the query heads (a copy per call)
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    q, k, v = _as_bhsd(q), _as_bhsd(k), _as_bhsd(v)
    if backend == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
    elif backend == "flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    out, lse = res[0], res[1]
    return out[0].transpose(0, 1), lse.reshape(hq, n).float()


@triton.jit
def _sink_rescale_kernel(src_ptr, lse_ptr, sinks_ptr, out_ptr, n, src_row, src_head, out_row, lse_head,
                         HEADS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, HEADS)
    t_ok = t < n
    lse = tl.load(lse_ptr + h[None, :] * lse_head + t[:, None], mask=t_ok[:, None], other=0.0)  # [BT, H]
    sink = tl.load(sinks_ptr + h).to(tl.float32)
    w = 1.0 / (1.0 + tl.exp(sink[None, :] - lse))  # sigmoid(lse - sink)
    d = tl.arange(0, D)
    src = tl.load(src_ptr + t[:, None, None] * src_row + h[None, :, None] * src_head + d[None, None, :],
                  mask=t_ok[:, None, None], other=0.0)
    val = (src.to(tl.float32) * w[:, :, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t[:, None, None] * out_row + h[None, :, None] * D + d[None, None, :], val,
             mask=t_ok[:, None, None])


def sink_rescale(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                 dest: torch.Tensor | None = None) -> torch.Tensor:
    """out * sigmoid(lse - sink) per (token, head), computed in fp32 and rounded once into `dest` [N, H, D]
    (a new tensor if None). out [N, H, D] may be a strided view; lse [H, N] fp32."""
    n, heads, d = out.shape
    dest = torch.empty((n, heads, d), dtype=out.dtype, device=out.device) if dest is None else dest
    if out.device.type != "cuda":
        w = torch.sigmoid(lse - sinks.float()[:, None]).t()[..., None]
        dest.copy_((out.float() * w).to(out.dtype))
        return dest
    if out.stride(2) != 1 or dest.stride(2) != 1 or dest.stride(1) != d or lse.stride(1) != 1:
        raise ValueError("sink_rescale needs contiguous head_dim rows, dest [N, H, D] row-major, lse [H, N]")
    block_t = 4
    _sink_rescale_kernel[(triton.cdiv(n, block_t),)](
        out, lse, sinks.contiguous(), dest, n, out.stride(0), out.stride(1), dest.stride(0), lse.stride(0),
        HEADS=heads, D=d, BLOCK_T=block_t, num_warps=4)
    return dest


def dense_sink_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
                       backend: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sink attention of one whole prompt: q [N, Hq, D] over its own k, v [N, Hkv, D], full causal."""
    got, lse = causal_attention_lse(q, k, v, scale, backend)
    return sink_rescale(got, lse, sinks, out)
