"""The front of a decode-sized MoE layer in one launch: router GEMV + bias -> top-k softmax -> masked
plan (counts, ranks, active experts) -> FP8 quantization of the tokens for the gate_up GEMM.

Unfused, these are five launches per layer (router GEMM + its split-K reduce, topk_softmax, a memset
of the counts, the count/rank kernel, dispatch_quant): ~12 us of kernels plus their launch gaps at
batch 1, where the layer's expert weights stream in ~40 us. Here one launch, and no serial loops
(on the H200 every dependent global round trip costs ~1-2 us in a single program; a first version
quantizing in the tail program's 23-step loop took 82 us per call,
bench/results/decode_ab_v1_serial_tail_gpt-oss-20b_h200.json; this one 6.0-9.8 us):

- grid (expert block, 128-channel block): each program computes one [T, 32] slice of the router
  logits over 128 channels (bf16 tensor-core dot, fp32 sums) into a scratch, and the programs of the first expert block quantize
  their 128 channels of every token (FP8, one scale per token per block) into token rows of A;
- the last program to finish (an atomic ticket, reset by that program for the next call) sums the
  slices in a fixed order (the logits do not depend on which program came last), adds the bias,
  rounds to bf16 as the router's bf16 nn.Linear does, picks the top k (ties to the lower id) with an
  fp32 softmax over them, ranks each expert's pairs in pair order (a prefix sum, no atomics: the
  ranks of the twin fp8_reference.count_and_rank), lists the active experts in ascending order, and
  writes token_of_row: the gate_up GEMM reads its A rows through it (tokens are not copied per pair).

Only for T <= FRONT_MAX_TOKENS and bf16 activations. The plan is routing_triton.plan_masked's with
m_cap = T plus token_of_row, the layout the Triton decode GEMM reads. Twin: fp8_reference.decode_front.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.moe.epilogues_triton import Fp8Rows
from kernels.moe.routing_triton import MoePlan
from kernels.pdl import pdl_prologue
from kernels.triton_rounding import round_to_bf16

FRONT_MAX_TOKENS = 16
BLOCK_T = 16  # tl.dot needs 16 rows; decode batches below that are masked
BLOCK_E = 32  # router rows (experts) per program
QBLOCK = 128  # channels per program: one quantization block


def default_num_warps(num_tokens: int, num_experts: int) -> int:
    """H200, bench/decode_front_sweep (2026-11-30, bench/results/decode_front_h200.json): 8 warps but for
    120b's 128 experts at T <= 4 (4 warps: 7.2 vs 7.3 us at T=1); 5.96-9.8 us against 11.6-12.6 unfused."""
    return 4 if num_experts > 64 and num_tokens <= 4 else 8


@triton.jit
def _decode_front_kernel(x_ptr, wr_ptr, br_ptr, partial_ptr, ticket_ptr,
                         ids_ptr, weights_ptr, counts_ptr, active_ptr, row_of_pair_ptr, token_of_row_ptr,
                         a_ptr, sf_ptr, num_tokens, hidden, num_experts, first_expert, num_local,
                         stride_x, stride_w, stride_a, sf_k_stride,
                         TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, E_PAD: tl.constexpr,
                         NUM_KB: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_L: tl.constexpr,
                         TAIL_T: tl.constexpr, DOT_BF16: tl.constexpr, PDL: tl.constexpr):
    eb, kb = tl.program_id(0), tl.program_id(1)
    experts = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    kk = kb * 128 + tl.arange(0, 128)
    k_ok = kk < hidden
    w_ptrs = wr_ptr + experts[:, None] * stride_w + kk[None, :]
    w_mask = (experts < num_experts)[:, None] & k_ok[None, :]
    cols = tl.arange(0, E_PAD)
    c_ok = cols < num_experts
    # the router's rows and bias are no predecessor's output: loaded before the PDL wait, they arrive while the
    # predecessor (the post-attention norm) finishes (kernels/moe/NOTES.md, "Weights before the PDL wait")
    wb = tl.load(w_ptrs, mask=w_mask, other=0.0)
    bias = tl.load(br_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)  # for whichever program routes
    pdl_prologue(PDL)
    toks = tl.arange(0, BLOCK_T)
    t_ok = toks < num_tokens
    # ---- 1. one [T, 32-expert] slice of the logits over channels [kb*128, +128); token rows of A
    xb = tl.load(x_ptr + toks[:, None] * stride_x + kk[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
    xa = xb.to(tl.float32)
    if DOT_BF16:  # tensor cores: exact bf16 products, fp32 sums
        acc = tl.dot(xb, tl.trans(wb))
    else:  # the same values on fp32 operands: Triton's interpreter multiplies bf16 dot operands as raw integers
        acc = tl.dot(xa, tl.trans(wb.to(tl.float32)), input_precision="ieee")
    tl.store(partial_ptr + kb * BLOCK_T * E_PAD + toks[:, None] * E_PAD + experts[None, :], acc, mask=t_ok[:, None])
    if eb == 0:  # per-128 FP8 quantization, scale = max(amax, 1e-4) / 448 (IEEE division), as the twin
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xa), axis=1), 1e-4), 448.0)
        q = tl.math.div_rn(xa, scale[:, None]).to(tl.float8e4nv)
        tl.store(a_ptr + toks[:, None].to(tl.int64) * stride_a + kk[None, :], q, mask=t_ok[:, None])
        tl.store(sf_ptr + kb * sf_k_stride + toks, scale, mask=t_ok)
    # ---- 2. the last program (release/acquire ticket) routes
    tl.debug_barrier()  # every thread's stores done before the one thread taking the ticket releases them
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) * NUM_KB - 1:
        tl.store(ticket_ptr, 0)  # ready for the next call (CUDA-graph replays included)
        # the tail works on next_pow2(T) rows, not the dot's 16: its per-thread work is what it costs
        tt = tl.arange(0, TAIL_T)
        tt_ok = tt < num_tokens
        logits = tl.zeros([TAIL_T, E_PAD], dtype=tl.float32)
        for s in tl.static_range(NUM_KB):  # fixed order: the same sum whichever program came last
            logits += tl.load(partial_ptr + s * BLOCK_T * E_PAD + tt[:, None] * E_PAD + cols[None, :],
                              mask=tt_ok[:, None] & c_ok[None, :], other=0.0, cache_modifier=".cg")
        logits = round_to_bf16(logits + bias[None, :])
        logits = tl.where(c_ok[None, :], logits, -float("inf"))
        # top-k in one pass (ties to the lower expert id), then the softmax over the k in fp32
        jj = tl.arange(0, BLOCK_J)
        chosen = tl.full([TAIL_T, BLOCK_J], -1, dtype=tl.int32)
        picked = tl.full([TAIL_T, BLOCK_J], -float("inf"), dtype=tl.float32)
        rest = logits
        for j in tl.static_range(TOP_K):
            best = tl.max(rest, axis=1)
            idx = tl.min(tl.where(rest == best[:, None], cols[None, :], E_PAD), axis=1)
            chosen = tl.where(jj[None, :] == j, idx[:, None], chosen)
            picked = tl.where(jj[None, :] == j, best[:, None], picked)
            rest = tl.where(cols[None, :] == idx[:, None], -float("inf"), rest)
        pair_ok = tt_ok[:, None] & (jj[None, :] < TOP_K)
        top = tl.max(picked, axis=1)
        p = tl.where(jj[None, :] < TOP_K, tl.exp(picked - top[:, None]), 0.0)
        pairs = tt[:, None] * TOP_K + jj[None, :]
        tl.store(ids_ptr + pairs, chosen, mask=pair_ok)
        tl.store(weights_ptr + pairs, p / tl.sum(p, axis=1)[:, None], mask=pair_ok)
        # masked plan: rank = earlier pairs (in pair order) of the same local expert
        e_loc = chosen - first_expert
        local = pair_ok & (e_loc >= 0) & (e_loc < num_local)
        lanes = tl.arange(0, BLOCK_L)
        flat = tl.reshape(tl.where(local, e_loc, -1), [TAIL_T * BLOCK_J])
        onehot = (flat[:, None] == lanes[None, :]).to(tl.int32)  # [pairs, local experts]
        rank = tl.reshape(tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1), axis=1), [TAIL_T, BLOCK_J])
        row = e_loc * num_tokens + rank  # m_cap = T rows per expert
        tl.store(row_of_pair_ptr + pairs, tl.where(local, row, -1), mask=pair_ok)
        tl.store(token_of_row_ptr + row, tl.broadcast_to(tt[:, None], [TAIL_T, BLOCK_J]), mask=local)
        counts = tl.sum(onehot, axis=0)
        l_ok = lanes < num_local
        tl.store(counts_ptr + lanes, counts, mask=l_ok)
        act = (counts > 0) & l_ok
        tl.store(active_ptr + tl.cumsum(act.to(tl.int32), axis=0) - 1, lanes, mask=act)
        tl.store(counts_ptr + num_local, tl.sum(act.to(tl.int32), axis=0))


class DecodeFrontError(ValueError):
    """The fused front cannot run these shapes; the message says which."""


def new_ticket(device) -> torch.Tensor:
    """The per-layer ticket counter the kernel reads and resets (zero between calls)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def decode_front(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, top_k: int,
                 first_expert: int, num_local: int, k_padded: int, ticket: torch.Tensor, num_warps: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, MoePlan, Fp8Rows]:
    """x [T, D] bf16, router [E, D] / [E] -> (expert ids [T, k] int32, weights [T, k] fp32, the masked plan
    with m_cap = T and token_of_row, the token rows [T, Kp] fp8 of the gate_up GEMM's A)."""
    t, d = x.shape
    e = router_weight.shape[0]
    if not 0 < t <= FRONT_MAX_TOKENS or x.dtype != torch.bfloat16 or router_weight.shape != (e, d) \
            or router_bias.shape != (e,) or k_padded % QBLOCK or not d <= k_padded < d + QBLOCK or top_k > e:
        raise DecodeFrontError(f"decode_front: x {tuple(x.shape)} {x.dtype} (1..{FRONT_MAX_TOKENS} bf16 rows), router "
                               f"{tuple(router_weight.shape)}/{tuple(router_bias.shape)}, k={top_k}, Kp={k_padded}")
    x, router_weight = x.contiguous(), router_weight.contiguous()
    dev = x.device
    e_blocks = triton.cdiv(e, BLOCK_E)
    e_pad = triton.next_power_of_2(e_blocks * BLOCK_E)  # the tail's logits row (a power of two)
    num_kb = k_padded // QBLOCK
    partial = torch.empty(num_kb, BLOCK_T, e_pad, dtype=torch.float32, device=dev)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    counts = torch.empty(num_local + 1, dtype=torch.int32, device=dev)  # last: number of active experts
    active = torch.empty(max(1, min(t * top_k, num_local)), dtype=torch.int32, device=dev)
    row_of_pair = torch.empty(t * top_k, dtype=torch.int32, device=dev)
    token_of_row = torch.empty(num_local * t, dtype=torch.int32, device=dev)
    a = Fp8Rows.empty(1, t, k_padded, dev)
    _decode_front_kernel[(e_blocks, num_kb)](
        x, router_weight, router_bias, partial, ticket, ids, weights, counts, active, row_of_pair, token_of_row,
        a.data, a.scale_storage, t, d, e, first_expert, num_local,
        x.stride(0), router_weight.stride(0), a.data.stride(0), a.sf_k_stride,
        TOP_K=top_k, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, E_PAD=e_pad, NUM_KB=num_kb,
        BLOCK_J=triton.next_power_of_2(top_k), BLOCK_L=triton.next_power_of_2(max(num_local, 2)),
        TAIL_T=triton.next_power_of_2(t), DOT_BF16=x.is_cuda, num_warps=num_warps or default_num_warps(t, e),
        **pdl.launch(x))
    plan = MoePlan("masked", row_of_pair, counts[:num_local], num_local * t, t, active=active,
                   num_active=counts[num_local:], token_of_row=token_of_row)
    return ids, weights, plan, a
