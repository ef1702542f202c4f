"""The front of a decode-sized MoE layer in one launch: router GEMV + bias -> top-k softmax -> masked
plan (counts, ranks, active experts) -> FP8 quantization of each token into its pairs' GEMM rows.

Unfused, these are five launches per layer (router GEMM, topk_softmax, a memset of the counts, the
count/rank kernel, dispatch_quant), each a few microseconds of launch gap at batch 1, where the whole
layer's expert weights stream in ~40 us. Here:

- programs (expert block, K split) each compute a slice of the router logits [T, E] in fp32 and
  write it to a scratch; the last program to finish (an atomic ticket, reset by that program for the
  next call) sums the slices in a fixed order, so the logits do not depend on which program was last;
- that program adds the bias, rounds to bf16 (as the router's bf16 nn.Linear does), picks the top k
  (ties to the lower id) with an fp32 softmax over them, ranks the pairs of each expert in pair order
  (a prefix sum, no atomics: the same ranks as the twin fp8_reference.count_and_rank), lists the
  active experts in ascending order, and quantizes each token once for all its k rows.

Only for T <= FRONT_MAX_TOKENS (one program does the tail) and bf16 activations. The result is the
masked plan of routing_triton.plan_masked with m_cap = T, the layout the Triton decode GEMM reads.
Twin: fp8_reference.decode_front.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.epilogues_triton import Fp8Rows
from kernels.moe.routing_triton import MoePlan
from kernels.triton_rounding import round_to_bf16

FRONT_MAX_TOKENS = 16
BLOCK_T = 16  # tl.dot needs 16 rows; decode batches below that are masked
BLOCK_E = 32  # router rows (experts) per program
BLOCK_K = 128  # hidden channels per dot step (one quantization block)
K_SPLITS = 8  # programs along the hidden dimension


@triton.jit
def _decode_front_kernel(x_ptr, wr_ptr, br_ptr, partial_ptr, ticket_ptr,
                         ids_ptr, weights_ptr, counts_ptr, active_ptr, row_of_pair_ptr, a_ptr, sf_ptr,
                         num_tokens, hidden, num_experts, first_expert, num_local, k_per_split,
                         stride_x, stride_w, stride_a, sf_group_stride, sf_k_stride,
                         TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, E_PAD: tl.constexpr,
                         BLOCK_K: tl.constexpr, K_SPLITS: tl.constexpr, BLOCK_J: tl.constexpr,
                         BLOCK_L: tl.constexpr, NUM_KB: tl.constexpr):
    eb, split = tl.program_id(0), tl.program_id(1)
    toks = tl.arange(0, BLOCK_T)
    t_ok = toks < num_tokens
    # ---- 1. this program's slice of the router logits: experts [eb*BLOCK_E, +BLOCK_E), one K range
    experts = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = experts < num_experts
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < hidden
        xa = tl.load(x_ptr + toks[:, None] * stride_x + kk[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        wb = tl.load(wr_ptr + experts[:, None] * stride_w + kk[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        # fp32 operands (exact bf16 products, fp32 sums, as the tensor-core path): Triton's interpreter
        # multiplies bf16 dot operands as raw integers (Triton 3.9), and this dot is tiny either way
        acc = tl.dot(xa.to(tl.float32), tl.trans(wb.to(tl.float32)), acc, input_precision="ieee")
    slice_ptr = partial_ptr + split * BLOCK_T * E_PAD + toks[:, None] * E_PAD + experts[None, :]
    tl.store(slice_ptr, acc, mask=experts[None, :] < E_PAD)
    # ---- 2. the last program (release/acquire ticket) does the rest
    tl.debug_barrier()  # every thread's slice stored before the one thread taking the ticket releases it
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) * K_SPLITS - 1:
        tl.store(ticket_ptr, 0)  # ready for the next call (CUDA-graph replays included)
        cols = tl.arange(0, E_PAD)
        c_ok = cols < num_experts
        logits = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
        for s in tl.static_range(K_SPLITS):  # fixed order: the same sum whichever program came last
            logits += tl.load(partial_ptr + s * BLOCK_T * E_PAD + toks[:, None] * E_PAD + cols[None, :],
                              mask=c_ok[None, :], other=0.0, cache_modifier=".cg")
        logits = round_to_bf16(logits + tl.load(br_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :])
        logits = tl.where(c_ok[None, :], logits, -float("inf"))
        # top-k (ties to the lower expert id) and the softmax over the k, as routing_triton.topk_softmax
        x = logits
        top = tl.max(x, axis=1)
        denom = tl.zeros([BLOCK_T], dtype=tl.float32)
        for _ in tl.static_range(TOP_K):
            v = tl.max(x, axis=1)
            idx = tl.min(tl.where(x == v[:, None], cols[None, :], E_PAD), axis=1)
            denom += tl.exp(v - top)
            x = tl.where(cols[None, :] == idx[:, None], -float("inf"), x)
        x = logits
        jj = tl.arange(0, BLOCK_J)
        chosen = tl.full([BLOCK_T, BLOCK_J], -1, dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            v = tl.max(x, axis=1)
            idx = tl.min(tl.where(x == v[:, None], cols[None, :], E_PAD), axis=1)
            tl.store(ids_ptr + toks * TOP_K + j, idx, mask=t_ok)
            tl.store(weights_ptr + toks * TOP_K + j, tl.exp(v - top) / denom, mask=t_ok)
            chosen = tl.where(jj[None, :] == j, idx[:, None], chosen)
            x = tl.where(cols[None, :] == idx[:, None], -float("inf"), x)
        # masked plan: rank = earlier pairs (in pair order) of the same local expert
        pair_ok = t_ok[:, None] & (jj[None, :] < TOP_K)
        e_loc = chosen - first_expert
        local = pair_ok & (e_loc >= 0) & (e_loc < num_local)
        lanes = tl.arange(0, BLOCK_L)
        flat = tl.reshape(tl.where(local, e_loc, -1), [BLOCK_T * BLOCK_J])
        onehot = (flat[:, None] == lanes[None, :]).to(tl.int32)  # [pairs, local experts]
        rank = tl.reshape(tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1), axis=1), [BLOCK_T, BLOCK_J])
        row = tl.where(local, e_loc * num_tokens + rank, -1)  # m_cap = T rows per expert
        tl.store(row_of_pair_ptr + toks[:, None] * TOP_K + jj[None, :], row, mask=pair_ok)
        counts = tl.sum(onehot, axis=0)
        l_ok = lanes < num_local
        tl.store(counts_ptr + lanes, counts, mask=l_ok)
        act = (counts > 0) & l_ok
        tl.store(active_ptr + tl.cumsum(act.to(tl.int32), axis=0) - 1, lanes, mask=act)
        tl.store(counts_ptr + num_local, tl.sum(act.to(tl.int32), axis=0))
        # ---- 3. each token quantized once per 128 channels, stored into its k rows
        g = tl.where(local, e_loc, 0)
        sf_dst = sf_ptr + g.to(tl.int64) * sf_group_stride + rank
        a_rows = a_ptr + row.to(tl.int64) * stride_a
        for kb in range(NUM_KB):
            c = kb * 128 + tl.arange(0, 128)
            xb = tl.load(x_ptr + toks[:, None] * stride_x + c[None, :], mask=t_ok[:, None] & (c[None, :] < hidden),
                         other=0.0).to(tl.float32)
            scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xb), axis=1), 1e-4), 448.0)
            q = tl.math.div_rn(xb, scale[:, None]).to(tl.float8e4nv)
            tl.store(a_rows[:, :, None] + c[None, None, :], tl.broadcast_to(q[:, None, :], [BLOCK_T, BLOCK_J, 128]),
                     mask=local[:, :, None])
            tl.store(sf_dst + kb * sf_k_stride, tl.broadcast_to(scale[:, None], [BLOCK_T, BLOCK_J]), mask=local)


class DecodeFrontError(ValueError):
    """The fused front cannot run these shapes; the message says which."""


def new_ticket(device) -> torch.Tensor:
    """The per-layer ticket counter the kernel reads and resets (zero between calls)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def decode_front(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, top_k: int,
                 first_expert: int, num_local: int, k_padded: int, ticket: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, MoePlan, Fp8Rows]:
    """x [T, D] bf16, router [E, D] / [E] -> (expert ids [T, k] int32, weights [T, k] fp32, the masked plan
    with m_cap = T, A rows [E_local groups x T rows, Kp] fp8 of the gate_up GEMM)."""
    t, d = x.shape
    e = router_weight.shape[0]
    if not 0 < t <= FRONT_MAX_TOKENS or x.dtype != torch.bfloat16 or router_weight.shape != (e, d) \
            or router_bias.shape != (e,) or k_padded % 128 or k_padded < d or top_k > e:
        raise DecodeFrontError(f"decode_front: x {tuple(x.shape)} {x.dtype} (1..{FRONT_MAX_TOKENS} bf16 rows), router "
                               f"{tuple(router_weight.shape)}/{tuple(router_bias.shape)}, k={top_k}, Kp={k_padded}")
    x, router_weight = x.contiguous(), router_weight.contiguous()
    dev = x.device
    e_blocks = triton.cdiv(e, BLOCK_E)
    e_pad = triton.next_power_of_2(e_blocks * BLOCK_E)  # the tail's logits row (a power of two)
    k_per_split = triton.cdiv(triton.cdiv(d, K_SPLITS), BLOCK_K) * BLOCK_K
    partial = torch.empty(K_SPLITS, BLOCK_T, e_pad, dtype=torch.float32, device=dev)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    counts = torch.empty(num_local + 1, dtype=torch.int32, device=dev)  # last: number of active experts
    active = torch.empty(max(1, min(t * top_k, num_local)), dtype=torch.int32, device=dev)
    row_of_pair = torch.empty(t * top_k, dtype=torch.int32, device=dev)
    a = Fp8Rows.empty(num_local, t, k_padded, dev)
    _decode_front_kernel[(e_blocks, K_SPLITS)](
        x, router_weight, router_bias, partial, ticket, ids, weights, counts, active, row_of_pair,
        a.data, a.scale_storage, t, d, e, first_expert, num_local, k_per_split,
        x.stride(0), router_weight.stride(0), a.data.stride(0), a.sf_group_stride, a.sf_k_stride,
        TOP_K=top_k, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, E_PAD=e_pad, BLOCK_K=BLOCK_K, K_SPLITS=K_SPLITS,
        BLOCK_J=triton.next_power_of_2(top_k), BLOCK_L=triton.next_power_of_2(max(num_local, 2)),
        NUM_KB=k_padded // 128, num_warps=4)
    plan = MoePlan("masked", row_of_pair, counts[:num_local], num_local * t, t, active=active,
                   num_active=counts[num_local:])
    return ids, weights, plan, a
