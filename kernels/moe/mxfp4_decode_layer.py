"""The experts of a decode-sized MoE layer read straight from the checkpoints' MXFP4 weights.

At small batches the CUDA C++ MXFP4 decode GEMM (`mxfp4_cuda.py`, `csrc/mxfp4_decode.cu`) streams the experts
faster than the FP8 decode GEMM (H200, 2026-12-01, weights from HBM: 20b gate_up T=1 16.7 vs 19.6 us, down
11.2 vs 12.6; 0.82-0.95x over both GEMMs at T = 1 and 4; 1.19-1.23x at T = 16: kernels/moe/NOTES.md). Both
weight formats then stay in memory (MXFP4 adds 17/32 byte per weight: ~10 GB for 20b, too much for 120b next
to its 117 GB of FP8 experts), so `Fp8Experts` takes this path only when the MXFP4 copy was attached
(`Fp8Experts.attach_mxfp4`, `EngineConfig.mxfp4_decode_max_tokens`) and the step has at most that many tokens.
In the 20b decode step: 1.02 / 1.06 / 1.07 / 1.05x at batch 1 / 2 / 4 / 8, 0.73x at 16 (python -m bench.decode_ab
--variants fused+pdl,mxfp4-decode, bench/results/decode_ab_mxfp4_decode_20b_h200.json).

After the fused decode front (router, top-k, masked plan with token_of_row), per layer:
  gate_up: h [E_local * T, 2I] bf16 = x[token_of_row] @ W13^T (exact MXFP4 weights, bf16 activations as fp16,
           fp32 sums, one bf16 rounding);
  swiglu_bf16: act = bf16(clamped SwiGLU(h + b13)) in fp32 (no FP8 quantization of the activations);
  down: y [E_local * T, D] bf16 = act @ W2^T;
  combine (epilogues_triton.combine): out[t] = sum_j w * (y + b2) in fp32.
So the activations are never rounded to FP8: the layer is closer to the bf16 reference than the FP8 path
(GPU test), and a step's numerics depend on which path its batch size took, as they do on GEMM shapes.

Twin: `decode_experts_reference` (pure torch, dequantized weights).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.moe.reference import clamped_swiglu
from kernels.pdl import pdl_prologue
from model.mxfp4 import dequantize_mxfp4

MAX_TOKENS = 16  # the CUDA kernel's two 8-token mma column tiles, and the fused front's limit
BLOCK_C = 128  # output channels per SwiGLU program


@triton.jit
def _swiglu_bf16_kernel(h_ptr, row_of_pair_ptr, ids_ptr, bias_ptr, out_ptr, inter, stride_h, stride_out,
                        stride_bias, first_expert, alpha, limit, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    # grid (pairs, channel blocks): output channel c comes from gate 2c and up 2c + 1, one contiguous run
    # of 2 * BLOCK inputs split in registers
    pair = tl.program_id(0)
    row = tl.load(row_of_pair_ptr + pair)
    if row >= 0:
        e = tl.load(ids_ptr + pair).to(tl.int32) - first_expert
        src = tl.program_id(1) * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
        ok = src < 2 * inter
        h = tl.load(h_ptr + row.to(tl.int64) * stride_h + src, mask=ok, other=0.0).to(tl.float32)
        h += tl.load(bias_ptr + e.to(tl.int64) * stride_bias + src, mask=ok, other=0.0)
        gate, up = tl.split(tl.reshape(h, (BLOCK, 2)))
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + row.to(tl.int64) * stride_out + col, act.to(out_ptr.dtype.element_ty), mask=col < inter)


def swiglu_bf16(h: torch.Tensor, row_of_pair: torch.Tensor, expert_ids: torch.Tensor, bias: torch.Tensor,
                first_expert: int, alpha: float, limit: float, out: torch.Tensor) -> torch.Tensor:
    """GEMM-1 rows h [rows, 2I] bf16 (gate, up interleaved) + bias [E_local, 2I] fp32 -> out [rows, I] bf16 =
    clamped SwiGLU computed in fp32, rounded once; only the rows of this rank's pairs are written."""
    inter = h.shape[1] // 2
    if h.dim() != 2 or out.shape != (h.shape[0], inter) or bias.shape[1] != 2 * inter:
        raise ValueError(f"swiglu_bf16: h {tuple(h.shape)}, out {tuple(out.shape)} and bias {tuple(bias.shape)} "
                         f"must be [rows, 2I], [rows, I] and [E_local, 2I]")
    p = row_of_pair.numel()
    if p:
        _swiglu_bf16_kernel[(p, triton.cdiv(inter, BLOCK_C))](
            h, row_of_pair, expert_ids, bias, out, inter, h.stride(0), out.stride(0), bias.stride(0),
            first_expert, float(alpha), float(limit), BLOCK=BLOCK_C, num_warps=2, **pdl.launch(h))
    return out


def swiglu_bf16_reference(h: torch.Tensor, bias: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Twin of swiglu_bf16 for rows h [M, 2I] with their experts' biases [M, 2I]."""
    return clamped_swiglu(h.float() + bias.float(), alpha, limit).bfloat16()


def decode_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, plan, packed13: dict, packed2: dict,
                   b13: torch.Tensor, b2: torch.Tensor, first_expert: int, alpha: float, limit: float) -> torch.Tensor:
    """This rank's experts for x [T, D] bf16 routed by the fused decode front (ids / weights [T, k], its masked
    plan with m_cap = T and token_of_row), from `mxfp4_cuda.pack_mma_words` weights. No host sync, no
    allocation outside torch's caching allocator: CUDA-graph capturable."""
    from kernels.moe import epilogues_triton as epi
    from kernels.moe import mxfp4_cuda

    t = x.shape[0]
    if plan.layout != "masked" or plan.rows_per_group != t or plan.token_of_row is None or not 0 < t <= MAX_TOKENS:
        raise ValueError(f"the MXFP4 decode experts take the fused front's masked plan with m_cap = T (1..{MAX_TOKENS}); "
                         f"got layout {plan.layout}, m_cap {plan.rows_per_group}, T {t}")
    rows = plan.num_rows
    h = torch.empty(rows, packed13["n"], dtype=torch.bfloat16, device=x.device)
    mxfp4_cuda.grouped_gemm_decode_mxfp4_mma(x, packed13, h, plan.counts, plan.active, plan.num_active, t, t,
                                             a_row_map=plan.token_of_row)
    act = swiglu_bf16(h, plan.row_of_pair, ids, b13, first_expert, alpha, limit,
                      torch.empty(rows, packed2["k"], dtype=torch.bfloat16, device=x.device))
    y = torch.empty(rows, packed2["n"], dtype=torch.bfloat16, device=x.device)
    mxfp4_cuda.grouped_gemm_decode_mxfp4_mma(act, packed2, y, plan.counts, plan.active, plan.num_active, t, t)
    out = torch.empty(t, packed2["n"], dtype=x.dtype, device=x.device)
    return epi.combine(y, plan.row_of_pair, ids, weights, b2, first_expert, out)


def decode_experts_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, blocks13: torch.Tensor,
                             scales13: torch.Tensor, b13: torch.Tensor, blocks2: torch.Tensor, scales2: torch.Tensor,
                             b2: torch.Tensor, first_expert: int, alpha: float, limit: float) -> torch.Tensor:
    """Twin of decode_experts: the same roundings (bf16 after each GEMM and after SwiGLU, fp32 sums and
    combine) with the MXFP4 weights dequantized; checkpoint layout blocks [E_local, N, K / 32, 16]."""
    t, k = ids.shape
    terms = torch.zeros(t, k, blocks2.shape[1], dtype=torch.float32, device=x.device)  # w * (y + b2) per pair
    local = ids.long() - first_expert
    for e in torch.unique(local).tolist():
        if not 0 <= e < blocks13.shape[0]:
            continue
        token, slot = torch.nonzero(local == e, as_tuple=True)
        w13 = dequantize_mxfp4(blocks13[e], scales13[e], torch.float32)
        w2 = dequantize_mxfp4(blocks2[e], scales2[e], torch.float32)
        h = (x[token].float() @ w13.T).bfloat16()
        act = swiglu_bf16_reference(h, b13[e].expand(len(token), -1), alpha, limit)
        y = (act.float() @ w2.T).bfloat16()
        terms[token, slot] = weights[token, slot, None].float() * (y.float() + b2[e].float())
    out = torch.zeros(t, blocks2.shape[1], dtype=torch.float32, device=x.device)
    for j in range(k):  # combine's fixed slot order
        out += terms[:, j]
    return out.to(x.dtype)
