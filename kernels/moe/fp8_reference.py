"""Pure-torch twins of the FP8 MoE kernels, and the CPU path of `Fp8Experts`.

The GPU pipeline of one MoE layer (T tokens, k experts each, P = T*k token-expert pairs):

  count_and_rank   pairs -> per-expert counts and each pair's rank inside its expert (atomics)
  layout           contiguous: expert segments aligned to 128 rows, row_of_pair, m_indices / psum
                   masked:     row = expert * m_cap + rank, masked_m = counts
  dispatch_quant   x[token] -> fp8 row of A (per-128 scales), K zero-padded 2880 -> 2944
  grouped GEMM     A @ W13[e]^T -> bf16 [rows, 2I]                     (DeepGEMM or Triton)
  swiglu_quant     + bias, de-interleave, clamp, SwiGLU, fp8 row of A2
  grouped GEMM     A2 @ W2[e]^T -> bf16 [rows, D]
  combine          out[t] = sum_j w[t, j] * (y[row(t, j)] + b2[e])    (fp32 accumulation)

Each function here computes one stage the way its kernel does (same formulas, same rounding points)
so the kernels can be compared with them on any input; `fp8_moe_forward` chains them and is what
`Fp8Experts` runs on the CPU.
"""

from __future__ import annotations

import torch

from kernels.moe.fp8_quant import BLOCK, dequantize_rows, dequantize_weight_blocks, padded, quantize_rows
from kernels.moe.reference import clamped_swiglu


# ---- routing -----------------------------------------------------------------------------------
def topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts (descending; ties to the lower index), softmax over those k in fp32."""
    values, ids = torch.sort(logits.float(), dim=-1, descending=True, stable=True)
    return ids[:, :k].to(torch.int32), torch.softmax(values[:, :k], dim=-1)


def count_and_rank(expert_ids: torch.Tensor, first_expert: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens per local expert [E_local] and each pair's rank within its expert [P] (-1: not local).

    The kernel hands out ranks with atomics, in no fixed order; this twin ranks in pair order. Any
    rank assignment that numbers each expert's pairs 0..count-1 is valid."""
    e = expert_ids.reshape(-1).long() - first_expert
    local = (e >= 0) & (e < num_local)
    onehot = torch.zeros(e.numel(), num_local, dtype=torch.int32, device=e.device)
    onehot[local.nonzero(as_tuple=True)[0], e[local]] = 1
    ranks = onehot.cumsum(0).gather(1, e.clamp(0, num_local - 1)[:, None])[:, 0] - 1
    counts = onehot.sum(0, dtype=torch.int32)
    return counts, torch.where(local, ranks, -1).to(torch.int32)


def contiguous_rows_bound(num_pairs: int, num_local: int, align_rows: int) -> int:
    """Rows the contiguous layout may need, known without reading the counts (no host sync): every
    non-empty expert wastes at most align-1 rows, and at most min(E_local, P) experts are non-empty."""
    return max(align_rows, -(-(num_pairs + min(num_local, num_pairs) * (align_rows - 1)) // align_rows) * align_rows)


def contiguous_layout(expert_ids: torch.Tensor, ranks: torch.Tensor, counts: torch.Tensor, first_expert: int,
                      align_rows: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_of_pair [P], m_indices [num_rows], psum [E_local]) of DeepGEMM's contiguous layout.

    Expert e owns rows [start_e, start_e + count_e), start_e = sum of align(count, 128) before it;
    m_indices names each row's expert, -1 for padding; psum[e] = start_e + count_e (the 'psum'
    variant DeepGEMM also accepts, which schedules only real blocks)."""
    num_local = counts.numel()
    counts = counts.long()
    aligned = (counts + align_rows - 1) // align_rows * align_rows
    ends = aligned.cumsum(0)
    starts = ends - aligned
    e = expert_ids.reshape(-1).long() - first_expert
    local = (e >= 0) & (e < num_local)
    row_of_pair = torch.where(local, starts[e.clamp(0, num_local - 1)] + ranks.long(), -1)
    rows = torch.arange(num_rows, device=counts.device)
    e_of_row = torch.searchsorted(ends, rows, right=True).clamp(max=num_local - 1)
    valid = (rows - starts[e_of_row] < counts[e_of_row]) & (rows >= starts[e_of_row])
    m_indices = torch.where(valid, e_of_row, -1)
    return row_of_pair.to(torch.int32), m_indices.to(torch.int32), (starts + counts).to(torch.int32)


def masked_layout(expert_ids: torch.Tensor, ranks: torch.Tensor, first_expert: int, num_local: int,
                  m_cap: int) -> torch.Tensor:
    """row_of_pair [P] for DeepGEMM's masked layout [E_local, m_cap, K]: row = e * m_cap + rank."""
    e = expert_ids.reshape(-1).long() - first_expert
    local = (e >= 0) & (e < num_local)
    return torch.where(local, e * m_cap + ranks.long(), -1).to(torch.int32)


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The router's nn.Linear: fp32 accumulation plus bias, rounded once to the activations' dtype."""
    return (x.float() @ weight.float().T + bias.float()).to(x.dtype)


def decode_front(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, first_expert: int,
                 num_local: int, k_padded: int):
    """Twin of decode_front_triton.decode_front: (ids, weights, counts, row_of_pair with m_cap = T,
    token_of_row [E_local * T] (-1 where no pair lands), the token rows of A [T, Kp] fp8 and their
    scales [T, Kp/128])."""
    t = x.shape[0]
    ids, weights = topk_softmax(router_logits(x, weight, bias), top_k)
    counts, ranks = count_and_rank(ids, first_expert, num_local)
    row_of_pair = masked_layout(ids, ranks, first_expert, num_local, t)
    token_of_row = torch.full((num_local * t,), -1, dtype=torch.int32, device=x.device)
    pairs = (row_of_pair >= 0).nonzero(as_tuple=True)[0]
    token_of_row[row_of_pair[pairs].long()] = (pairs // top_k).to(torch.int32)
    a, sa = quantize_rows(x.float(), k_padded)
    return ids, weights, counts, row_of_pair, token_of_row, a, sa


# ---- epilogues ---------------------------------------------------------------------------------
def dispatch_quant(x: torch.Tensor, row_of_pair: torch.Tensor, top_k: int, num_rows: int,
                   k_padded: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [num_rows, Kp] fp8 and scales [num_rows, Kp/128] with x[pair // k] quantized into row_of_pair[pair].

    Rows no pair maps to are left as zeros here (the kernel leaves them unwritten); the third result
    is the mask of written rows."""
    kp = padded(x.shape[1]) if k_padded is None else k_padded
    q, s = quantize_rows(x.float(), kp)
    a = torch.zeros(num_rows, kp, dtype=q.dtype, device=x.device)
    sa = torch.zeros(num_rows, kp // BLOCK, dtype=torch.float32, device=x.device)
    written = torch.zeros(num_rows, dtype=torch.bool, device=x.device)
    pairs = (row_of_pair >= 0).nonzero(as_tuple=True)[0]
    rows = row_of_pair[pairs].long()
    a[rows], sa[rows], written[rows] = q[pairs // top_k], s[pairs // top_k], True
    return a, sa, written


def swiglu_quant(h: torch.Tensor, bias: torch.Tensor, alpha: float, limit: float,
                 k_padded: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM-1 rows [M, 2I] (bf16) + bias [M, 2I] (fp32, per row's expert) -> clamped SwiGLU ->
    fp8 [M, Ip] with per-128 scales (columns I..Ip zero)."""
    act = clamped_swiglu(h.float() + bias.float(), alpha, limit)
    return quantize_rows(act, padded(act.shape[1]) if k_padded is None else k_padded)


def combine(y: torch.Tensor, row_of_pair: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
            bias: torch.Tensor, first_expert: int, out_dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum over local pairs j of w[t, j] * (y[row] + b2[e]), accumulated in fp32."""
    t, k = expert_ids.shape
    out = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
    rows = row_of_pair.reshape(t, k).long()
    for j in range(k):  # fixed slot order, as in the kernel
        mine = rows[:, j] >= 0
        e = expert_ids[:, j].long() - first_expert
        term = y[rows[:, j].clamp(min=0)].float() + bias[e.clamp(0, bias.shape[0] - 1)].float()
        out += torch.where(mine[:, None], expert_weights[:, j, None].float() * term, 0.0)
    return out.to(out_dtype)


# ---- grouped GEMM ------------------------------------------------------------------------------
def grouped_gemm(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                 expert_of_row: torch.Tensor) -> torch.Tensor:
    """bf16 [M, N] = dequant(A) @ dequant(W[e])^T row by row, fp32 accumulation; rows with expert -1
    are zero (the kernels leave them unwritten)."""
    m, n = a.shape[0], w.shape[1]
    out = torch.zeros(m, n, dtype=torch.bfloat16, device=a.device)
    x = dequantize_rows(a, sa)
    for e in torch.unique(expert_of_row[expert_of_row >= 0]).tolist():
        rows = (expert_of_row == e).nonzero(as_tuple=True)[0]
        out[rows] = (x[rows] @ dequantize_weight_blocks(w[e:e + 1], sw[e:e + 1])[0].T).to(torch.bfloat16)
    return out


# ---- the whole layer ---------------------------------------------------------------------------
def fp8_moe_forward(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                    w13: torch.Tensor, s13: torch.Tensor, b13: torch.Tensor,
                    w2: torch.Tensor, s2: torch.Tensor, b2: torch.Tensor,
                    first_expert: int, alpha: float, limit: float) -> torch.Tensor:
    """The FP8 MoE layer in torch: what the GPU kernels compute, stage for stage (contiguous layout)."""
    t, k = expert_ids.shape
    num_local = w13.shape[0]
    counts, ranks = count_and_rank(expert_ids, first_expert, num_local)
    num_rows = contiguous_rows_bound(t * k, num_local, BLOCK)
    row_of_pair, m_indices, _ = contiguous_layout(expert_ids, ranks, counts, first_expert, BLOCK, num_rows)
    a, sa, _ = dispatch_quant(x, row_of_pair, k, num_rows, w13.shape[2])
    h = grouped_gemm(a, sa, w13, s13, m_indices)
    e_of_row = m_indices.clamp(min=0).long()
    a2, sa2 = swiglu_quant(h, b13[e_of_row], alpha, limit, w2.shape[2])
    y = grouped_gemm(a2, sa2, w2, s2, m_indices)
    return combine(y, row_of_pair, expert_ids, expert_weights, b2, first_expert, x.dtype)
