"""Routing on the device: top-k + softmax, and the permutation of token-expert pairs into the
grouped GEMMs' layouts. No host synchronization anywhere: buffer sizes depend only on T, so the
whole path can be captured in a CUDA graph.

Shapes: T tokens, k experts per token, P = T*k pairs, E routed experts, E_local = this rank's experts.
Twins: kernels/moe/fp8_reference.py (topk_softmax, count_and_rank, contiguous_layout, masked_layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.moe.fp8_reference import contiguous_rows_bound


@triton.jit
def _topk_softmax_kernel(logits_ptr, ids_ptr, weights_ptr, num_tokens, num_experts, stride_t,
                         TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    col_ok = cols[None, :] < num_experts
    logits = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=row_ok[:, None] & col_ok,
                     other=0.0).to(tl.float32)
    logits = tl.where(col_ok, logits, -float("inf"))  # missing experts never win; missing rows stay finite
    # Pass 1: the k largest (ties to the lower expert id, like a stable sort) -> softmax denominator.
    x = logits
    top = tl.max(x, axis=1)
    denom = tl.zeros([BLOCK_T], dtype=tl.float32)
    for _ in tl.static_range(TOP_K):
        v = tl.max(x, axis=1)
        idx = tl.min(tl.where(x == v[:, None], cols[None, :], BLOCK_E), axis=1)
        denom += tl.exp(v - top)
        x = tl.where(cols[None, :] == idx[:, None], -float("inf"), x)
    # Pass 2: the same selection again, now writing ids and normalized weights (fp32).
    x = logits
    for j in tl.static_range(TOP_K):
        v = tl.max(x, axis=1)
        idx = tl.min(tl.where(x == v[:, None], cols[None, :], BLOCK_E), axis=1)
        tl.store(ids_ptr + rows * TOP_K + j, idx, mask=row_ok)
        tl.store(weights_ptr + rows * TOP_K + j, tl.exp(v - top) / denom, mask=row_ok)
        x = tl.where(cols[None, :] == idx[:, None], -float("inf"), x)


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (bias included) -> expert ids [T, k] int32, weights [T, k] fp32:
    top-k, then a softmax over the k chosen logits in fp32."""
    t, e = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t:
        block_t = 16 if e <= 64 else 4
        _topk_softmax_kernel[(triton.cdiv(t, block_t),)](
            logits, ids, weights, t, e, logits.stride(0), TOP_K=top_k, BLOCK_T=block_t,
            BLOCK_E=triton.next_power_of_2(e), num_warps=4)
    return ids, weights


@triton.jit
def _count_rank_kernel(ids_ptr, counts_ptr, ranks_ptr, row_of_pair_ptr, active_ptr, num_pairs, first_expert, num_local,
                       m_cap, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = pairs < num_pairs
    e = tl.load(ids_ptr + pairs, mask=in_range, other=-1).to(tl.int32) - first_expert
    local = in_range & (e >= 0) & (e < num_local)
    # Atomics hand out ranks in arbitrary order; every row's GEMM result is independent of its
    # position, and the combine sums each token's slots in a fixed order, so outputs stay bitwise stable.
    rank = tl.atomic_add(counts_ptr + e, 1, mask=local)
    rank = tl.where(local, rank, -1)
    tl.store(ranks_ptr + pairs, rank, mask=in_range)
    if MASKED:
        tl.store(row_of_pair_ptr + pairs, tl.where(local, e * m_cap + rank, -1), mask=in_range)
        # The pair ranked 0 of an expert lists it as active: counts[num_local] counts the active
        # experts, active[slot] names them (in no fixed order), so decode GEMMs launch one program
        # row per active expert instead of one per local expert.
        first = rank == 0
        slot = tl.atomic_add(counts_ptr + num_local + tl.zeros_like(pairs), 1, mask=first)
        tl.store(active_ptr + slot, e, mask=first)


@triton.jit
def _contiguous_layout_kernel(ids_ptr, counts_ptr, ranks_ptr, row_of_pair_ptr, m_indices_ptr, psum_ptr,
                              num_pairs, num_rows, first_expert, num_local,
                              ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr):
    # Every program recomputes the aligned prefix sum over the (at most a few hundred) local experts:
    # cheaper than a separate scan launch and a round trip through memory.
    experts = tl.arange(0, BLOCK_E)
    e_ok = experts < num_local
    counts = tl.load(counts_ptr + experts, mask=e_ok, other=0)
    aligned = (counts + ALIGN - 1) // ALIGN * ALIGN
    starts = tl.cumsum(aligned, axis=0) - aligned
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(psum_ptr + experts, starts + counts, mask=e_ok)
    # Rows of this block: which expert's real rows they are, else -1 (alignment padding / unused tail).
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    inside = (rows[:, None] >= starts[None, :]) & (rows[:, None] < (starts + counts)[None, :]) & e_ok[None, :]
    expert_of_row = tl.max(tl.where(inside, experts[None, :], -1), axis=1)
    tl.store(m_indices_ptr + rows, expert_of_row, mask=rows < num_rows)
    # Pairs of this block: row = start of its expert + its rank.
    pairs = rows
    p_ok = pairs < num_pairs
    e = tl.load(ids_ptr + pairs, mask=p_ok, other=-1).to(tl.int32) - first_expert
    local = p_ok & (e >= 0) & (e < num_local)
    start = tl.sum(tl.where(experts[None, :] == e[:, None], starts[None, :], 0), axis=1)
    rank = tl.load(ranks_ptr + pairs, mask=p_ok, other=0)
    tl.store(row_of_pair_ptr + pairs, tl.where(local, start + rank, -1), mask=p_ok)


@dataclass
class MoePlan:
    """Where each token-expert pair goes. `row_of_pair[p]` is the row of A / of the GEMM outputs that
    holds pair p (-1: expert not on this rank). Contiguous: rows [num_rows] with `m_indices` (expert
    or -1 per row) and `psum` (end row of each expert's segment, segments starting 128-aligned).
    Masked: rows [E_local * m_cap], expert e owns rows [e*m_cap, e*m_cap + counts[e])."""

    layout: str  # "contiguous" or "masked"
    row_of_pair: torch.Tensor  # [P] int32
    counts: torch.Tensor  # [E_local] int32 (the masked GEMM's masked_m)
    num_rows: int
    rows_per_group: int  # masked: m_cap; contiguous: num_rows (one group)
    m_indices: torch.Tensor | None = None
    psum: torch.Tensor | None = None
    # masked: the experts with pairs, active[:num_active] in no fixed order (num_active: [1] int32)
    active: torch.Tensor | None = None
    num_active: torch.Tensor | None = None
    # masked, fused decode front only: row r of the gate_up GEMM reads token row token_of_row[r] of A
    # (A holds each token once); None: A holds one row per pair at row_of_pair
    token_of_row: torch.Tensor | None = None

    @property
    def num_groups(self) -> int:
        return self.num_rows // self.rows_per_group


def plan_masked(expert_ids: torch.Tensor, first_expert: int, num_local: int, m_cap: int | None = None) -> MoePlan:
    """Masked layout: one launch (count + rank + row + active experts). m_cap defaults to T: a token
    picks distinct experts, so no expert gets more than T pairs."""
    t, k = expert_ids.shape
    m_cap = t if m_cap is None else m_cap
    p = t * k
    dev = expert_ids.device
    counts = torch.zeros(num_local + 1, dtype=torch.int32, device=dev)  # last: number of active experts
    ranks = torch.empty(p, dtype=torch.int32, device=dev)
    row_of_pair = torch.empty(p, dtype=torch.int32, device=dev)
    active = torch.empty(max(1, min(p, num_local)), dtype=torch.int32, device=dev)
    if p:
        _count_rank_kernel[(triton.cdiv(p, 256),)](
            expert_ids, counts, ranks, row_of_pair, active, p, first_expert, num_local, m_cap, MASKED=True, BLOCK=256)
    return MoePlan("masked", row_of_pair, counts[:num_local], num_local * m_cap, m_cap,
                   active=active, num_active=counts[num_local:])


def plan_contiguous(expert_ids: torch.Tensor, first_expert: int, num_local: int, align_rows: int) -> MoePlan:
    """Contiguous layout: count + rank, then the aligned prefix sum, rows and m_indices/psum."""
    t, k = expert_ids.shape
    p = t * k
    dev = expert_ids.device
    num_rows = contiguous_rows_bound(p, num_local, align_rows)
    counts = torch.zeros(num_local, dtype=torch.int32, device=dev)
    ranks = torch.empty(p, dtype=torch.int32, device=dev)
    row_of_pair = torch.empty(p, dtype=torch.int32, device=dev)
    m_indices = torch.empty(num_rows, dtype=torch.int32, device=dev)
    psum = torch.empty(num_local, dtype=torch.int32, device=dev)
    if p:
        _count_rank_kernel[(triton.cdiv(p, 256),)](
            expert_ids, counts, ranks, row_of_pair, ranks, p, first_expert, num_local, 0, MASKED=False, BLOCK=256)
    block = 128
    _contiguous_layout_kernel[(triton.cdiv(max(num_rows, p), block),)](
        expert_ids, counts, ranks, row_of_pair, m_indices, psum, p, num_rows, first_expert, num_local,
        ALIGN=align_rows, BLOCK_E=triton.next_power_of_2(num_local), BLOCK=block, num_warps=4)
    return MoePlan("contiguous", row_of_pair, counts, num_rows, num_rows, m_indices, psum)
