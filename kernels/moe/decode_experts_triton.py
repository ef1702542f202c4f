"""The experts of a decode step in one launch: gate_up GEMM -> SwiGLU + quantization -> down GEMM -> combine.

At batch 1 the MoE layer after the fused front was four dependent launches (decode GEMM, swiglu_quant, decode
GEMM, combine): each waited for the whole previous grid to drain, and the layer ran ~21 us above its weight
floor (kernels/moe/NOTES.md). Here the same work is one grid whose programs hand results to each other
through counters in global memory, so a stage starts where its inputs are ready rather than after the
slowest program of the previous stage:

- programs [0, GA): gate_up tiles (K split S ways, as the decode GEMM), fp32 partials to h [S, rows, 2I].
  The last of the programs feeding one 128-channel block of the activation (an atomic ticket per (expert
  slot, block), reset by that program) sums the S partials in a fixed order, rounds to bf16, adds the bias,
  applies the clamped SwiGLU, quantizes (epilogues_triton.swiglu_quant_rows) and raises the block's flag;
- programs [GA, GA + GB): down tiles. Each waits for the flags of its K range (acquire loads in a loop),
  then streams its weights; fp32 partials to y [S, rows, D]. The last of the programs of one D tile
  (ticket per tile) combines it: per token, the k experts' rows (partials summed in order, rounded to
  bf16, + bias) times the routing weights, summed in fp32 in slot order. The last program of the grid
  clears the flags for the next call.

Every value is computed in the order, and rounded where, the separate kernels compute and round it, so the
output is bitwise theirs (tests: interpreter cases, GPU). Waiting programs never block the ones they wait
for: a 1-D grid's programs are dispatched in order, so every gate_up program is resident or done before
the first down program runs, and under PDL the next kernel is scheduled only once every program here has
started. Within a stage the split index runs fastest and the expert slot slowest: the programs of one
block finish together and the first expert's down tiles can stream while later experts' gate_up tiles run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.moe.epilogues_triton import Fp8Rows, swiglu_quant_rows
from kernels.moe.fp8_quant import BLOCK
from kernels.pdl import pdl_prologue
from kernels.triton_rounding import round_to_bf16

BLOCK_N = 64  # weight rows per program (DECODE_CONFIG's tile)
SYNC_SLOTS = 64  # expert slots the sync buffer holds: T <= 16 tokens x top-4
TILES_PER_BLOCK = 2 * BLOCK // BLOCK_N  # gate_up tiles feeding one 128-channel block of the activation


class DecodeExpertsError(ValueError):
    """A call this kernel does not cover (sizes, layout); says which part."""


def sync_size(hidden: int, intermediate: int) -> int:
    """Counters of one layer: per (slot, activation block) a ticket and a flag, a ticket per down tile, one
    grid ticket."""
    return 2 * SYNC_SLOTS * (-(-intermediate // BLOCK)) + triton.cdiv(hidden, BLOCK_N) + 1


def new_sync(hidden: int, intermediate: int, device) -> torch.Tensor:
    """Zeroed counters for one layer's calls; each call leaves them zero again."""
    return torch.zeros(sync_size(hidden, intermediate), dtype=torch.int32, device=device)


@triton.jit
def _tile_dot(a_ptrs, sfa_ptrs, sfa_k_stride, b_ptrs, sfb_ptrs, t_ok, n_ok, kb0, kb1,
              BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, A_CACHE: tl.constexpr):
    """sum over k-blocks [kb0, kb1) of W tile [BLOCK_N, 128] x A^T tile [128, BLOCK_T], block-scaled, in fp32
    (the decode GEMM's loop)."""
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for kb in range(kb0, kb1):
        b = tl.load(b_ptrs, mask=n_ok[:, None], other=0.0)
        a = tl.load(a_ptrs, mask=t_ok[None, :], other=0.0, cache_modifier=A_CACHE)
        sa = tl.load(sfa_ptrs + kb * sfa_k_stride, mask=t_ok, other=0.0, cache_modifier=A_CACHE)
        sb = tl.load(sfb_ptrs + kb)
        acc += tl.dot(b, a) * (sb * sa[None, :])
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _decode_experts_kernel(
        counts_ptr, active_ptr, num_active_ptr, token_of_row_ptr, row_of_pair_ptr, ids_ptr, weights_ptr,
        a1_ptr, sfa1_ptr, w13_ptr, s13_ptr, b13_ptr, a2_ptr, sfa2_ptr, w2_ptr, s2_ptr, b2_ptr,
        h_ptr, y_ptr, out_ptr, sync_ptr,
        num_tokens, rows_per_group, n1, n2, inter, first_expert, alpha, limit,
        stride_a1, sfa1_k_stride, stride_w13g, stride_w13n, s13_g, s13_n, stride_b13,
        stride_a2, sfa2_g, sfa2_k_stride, stride_w2g, stride_w2n, s2_g, s2_n, stride_b2,
        stride_h, stride_hs, stride_y, stride_ys, stride_out,
        SLOTS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, NUM_KB1: tl.constexpr, NUM_KB2: tl.constexpr, SPLIT_K: tl.constexpr,
        PDL: tl.constexpr):
    pdl_prologue(PDL)
    TILES: tl.constexpr = 2 * BLOCK_K // BLOCK_N
    ticket_a = sync_ptr
    ready = sync_ptr + SLOTS * NUM_KB2
    ticket_c = ready + SLOTS * NUM_KB2
    nt1 = tl.cdiv(n1, BLOCK_N)
    nt2 = tl.cdiv(n2, BLOCK_N)
    ga = nt1 * SLOTS * SPLIT_K
    gb = nt2 * SLOTS * SPLIT_K
    grid_ticket = ticket_c + nt2
    pid = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    num_active = tl.load(num_active_ptr)
    if pid < ga:
        # ---- gate_up tile (split fastest, then N tile, then expert slot) ------------------------------
        split = pid % SPLIT_K
        pid_n = (pid // SPLIT_K) % nt1
        slot = pid // (SPLIT_K * nt1)
        if slot < num_active:
            expert = tl.load(active_ptr + slot)
            count = tl.load(counts_ptr + expert)
            kb_per: tl.constexpr = (NUM_KB1 + SPLIT_K - 1) // SPLIT_K
            kb0 = split * kb_per
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            t_ok = offs_t < count
            n_ok = offs_n < n1
            rows = expert.to(tl.int64) * rows_per_group + offs_t
            a_rows = tl.load(token_of_row_ptr + rows, mask=t_ok, other=0).to(tl.int64)
            a_ptrs = a1_ptr + a_rows[None, :] * stride_a1 + (kb0 * BLOCK_K + offs_k)[:, None]
            b_ptrs = (w13_ptr + expert.to(tl.int64) * stride_w13g + offs_n[:, None].to(tl.int64) * stride_w13n
                      + (kb0 * BLOCK_K + offs_k)[None, :])
            sfb_ptrs = s13_ptr + expert.to(tl.int64) * s13_g + (pid_n * BLOCK_N // BLOCK_K) * s13_n
            acc = _tile_dot(a_ptrs, sfa1_ptr + a_rows, sfa1_k_stride, b_ptrs, sfb_ptrs, t_ok, n_ok, kb0,
                            tl.minimum(kb0 + kb_per, NUM_KB1), BLOCK_N, BLOCK_T, BLOCK_K, "")
            tl.store(h_ptr + split * stride_hs + rows[None, :] * stride_h + offs_n[:, None], acc,
                     mask=t_ok[None, :] & n_ok[:, None])
            # ---- the last program of this 128-channel block: SwiGLU + quantization, then its flag -------
            j = pid_n // TILES
            feeding = tl.minimum(TILES, nt1 - j * TILES) * SPLIT_K
            tl.debug_barrier()  # every thread's partials stored before the ticket releases them
            ticket = tl.atomic_add(ticket_a + slot * NUM_KB2 + j, 1, sem="acq_rel")
            if ticket == feeding - 1:
                tl.store(ticket_a + slot * NUM_KB2 + j, 0)
                src = j * 2 * BLOCK_K + tl.arange(0, 2 * BLOCK_K)  # interleaved (gate, up) columns
                ok = t_ok[:, None] & (src < n1)[None, :]
                h_rows = h_ptr + rows[:, None] * stride_h + src[None, :]
                hv = tl.load(h_rows, mask=ok, other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):
                    hv += tl.load(h_rows + s * stride_hs, mask=ok, other=0.0, cache_modifier=".cg")
                hv = round_to_bf16(hv)  # as the decode GEMM's bf16 output (or swiglu_quant's split sum) rounds
                hv += tl.load(b13_ptr + expert.to(tl.int64) * stride_b13 + src, mask=src < n1, other=0.0)[None, :]
                col = j * BLOCK_K + tl.arange(0, BLOCK_K)
                q, scale = swiglu_quant_rows(hv, (col < inter)[None, :], alpha, limit, BLOCK_T, False)
                tl.store(a2_ptr + rows[:, None] * stride_a2 + col[None, :], q, mask=t_ok[:, None])
                tl.store(sfa2_ptr + expert.to(tl.int64) * sfa2_g + j * sfa2_k_stride + offs_t, scale, mask=t_ok)
                tl.debug_barrier()  # the block's rows and scales stored before the flag goes up
                tl.atomic_xchg(ready + slot * NUM_KB2 + j, 1, sem="release")
    else:
        # ---- down tile ---------------------------------------------------------------------------------
        pid_b = pid - ga
        split = pid_b % SPLIT_K
        pid_n = (pid_b // SPLIT_K) % nt2
        slot = pid_b // (SPLIT_K * nt2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n2
        if slot < num_active:
            expert = tl.load(active_ptr + slot)
            count = tl.load(counts_ptr + expert)
            kb_per2: tl.constexpr = (NUM_KB2 + SPLIT_K - 1) // SPLIT_K
            kb0 = split * kb_per2
            kb1 = tl.minimum(kb0 + kb_per2, NUM_KB2)
            for kb in range(kb0, kb1):  # wait for the activation blocks this split reads
                flag = tl.atomic_add(ready + slot * NUM_KB2 + kb, 0, sem="acquire")
                while flag == 0:
                    flag = tl.atomic_add(ready + slot * NUM_KB2 + kb, 0, sem="acquire")
            tl.debug_barrier()
            t_ok = offs_t < count
            rows = expert.to(tl.int64) * rows_per_group + offs_t
            a_ptrs = a2_ptr + rows[None, :] * stride_a2 + (kb0 * BLOCK_K + offs_k)[:, None]
            b_ptrs = (w2_ptr + expert.to(tl.int64) * stride_w2g + offs_n[:, None].to(tl.int64) * stride_w2n
                      + (kb0 * BLOCK_K + offs_k)[None, :])
            sfb_ptrs = s2_ptr + expert.to(tl.int64) * s2_g + (pid_n * BLOCK_N // BLOCK_K) * s2_n
            acc = _tile_dot(a_ptrs, sfa2_ptr + expert.to(tl.int64) * sfa2_g + offs_t, sfa2_k_stride, b_ptrs,
                            sfb_ptrs, t_ok, n_ok, kb0, kb1, BLOCK_N, BLOCK_T, BLOCK_K, ".cg")
            tl.store(y_ptr + split * stride_ys + rows[None, :] * stride_y + offs_n[:, None], acc,
                     mask=t_ok[None, :] & n_ok[:, None])
        # ---- the last program of this D tile combines it (idle slots count too) -------------------------
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_c + pid_n, 1, sem="acq_rel")
        if ticket == SLOTS * SPLIT_K - 1:
            tl.store(ticket_c + pid_n, 0)
            for t in range(num_tokens):
                acc_t = tl.zeros([BLOCK_N], dtype=tl.float32)
                for jj in tl.static_range(TOP_K):
                    pair = t * TOP_K + jj
                    row = tl.load(row_of_pair_ptr + pair)
                    if row >= 0:
                        e = tl.load(ids_ptr + pair).to(tl.int32) - first_expert
                        w = tl.load(weights_ptr + pair).to(tl.float32)
                        y_row = y_ptr + row.to(tl.int64) * stride_y + offs_n
                        yv = tl.load(y_row, mask=n_ok, other=0.0, cache_modifier=".cg")
                        for s in tl.static_range(1, SPLIT_K):
                            yv += tl.load(y_row + s * stride_ys, mask=n_ok, other=0.0, cache_modifier=".cg")
                        yv = round_to_bf16(yv)
                        yv += tl.load(b2_ptr + e.to(tl.int64) * stride_b2 + offs_n, mask=n_ok, other=0.0)
                        acc_t += w * yv
                tl.store(out_ptr + t * stride_out + offs_n, acc_t.to(out_ptr.dtype.element_ty), mask=n_ok)
        # ---- the grid's last program clears the flags ----------------------------------------------------
        done = tl.atomic_add(grid_ticket, 1, sem="acq_rel")
        if done == gb - 1:
            tl.store(grid_ticket, 0)
            for i in range(0, SLOTS * NUM_KB2, 256):
                idx = i + tl.arange(0, 256)
                tl.store(ready + idx, tl.zeros([256], dtype=tl.int32), mask=idx < SLOTS * NUM_KB2)


def decode_experts(a1: Fp8Rows, plan, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                   w13: torch.Tensor, s13: torch.Tensor, b13: torch.Tensor,
                   w2: torch.Tensor, s2: torch.Tensor, b2: torch.Tensor,
                   first_expert: int, alpha: float, limit: float, splits: int, sync: torch.Tensor,
                   out: torch.Tensor) -> torch.Tensor:
    """out [T, D] = the experts of decode_front's plan on A token rows a1, in one launch (see the module
    docstring). Same inputs as Fp8Experts' four-launch path; `sync` from new_sync, one per layer."""
    t, k = expert_ids.shape
    e_local, n1, kp1 = w13.shape
    _, n2, kp2 = w2.shape
    inter = n1 // 2
    slots = plan.active.numel()
    if plan.layout != "masked" or plan.token_of_row is None or a1.groups != 1:
        raise DecodeExpertsError("decode_experts takes decode_front's plan (masked, token rows) and its A rows")
    if slots > SYNC_SLOTS or t > BLOCK_N or plan.rows_per_group < t:
        raise DecodeExpertsError(f"{t} tokens over {slots} expert slots: at most {SYNC_SLOTS} slots and 64 tokens")
    if a1.data.shape[1] != kp1 or kp2 != -(-inter // BLOCK) * BLOCK or sync.numel() < sync_size(n2, inter):
        raise DecodeExpertsError(f"A [*, {a1.data.shape[1]}], W13 {tuple(w13.shape)}, W2 {tuple(w2.shape)} and a "
                                 f"{sync.numel()}-counter sync buffer do not fit together")
    dev = out.device
    rows = plan.num_rows
    h = torch.empty(splits, rows, n1, dtype=torch.float32, device=dev)
    y = torch.empty(splits, rows, n2, dtype=torch.float32, device=dev)
    a2 = Fp8Rows.empty(plan.num_groups, plan.rows_per_group, kp2, dev)
    grid = ((triton.cdiv(n1, BLOCK_N) + triton.cdiv(n2, BLOCK_N)) * slots * splits,)
    _decode_experts_kernel[grid](
        plan.counts, plan.active, plan.num_active, plan.token_of_row, plan.row_of_pair, expert_ids, expert_weights,
        a1.data, a1.scale_storage, w13, s13, b13, a2.data, a2.scale_storage, w2, s2, b2, h, y, out, sync,
        t, plan.rows_per_group, n1, n2, inter, first_expert, float(alpha), float(limit),
        a1.data.stride(0), a1.sf_k_stride, w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), b13.stride(0),
        a2.data.stride(0), a2.sf_group_stride, a2.sf_k_stride, w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        b2.stride(0), h.stride(1), h.stride(0), y.stride(1), y.stride(0), out.stride(0),
        SLOTS=slots, TOP_K=k, BLOCK_T=max(16, triton.next_power_of_2(plan.rows_per_group)), BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK, NUM_KB1=kp1 // BLOCK, NUM_KB2=kp2 // BLOCK, SPLIT_K=splits, num_warps=4, num_stages=3,
        **pdl.launch(out))
    return out
