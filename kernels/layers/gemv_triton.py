"""Decode-sized dense projections as a split-K GEMV: y [T, N] = x [T, K] @ W [N, K]^T (+ b), T <= 16.

At batch 1 the QKV and O projections are pure weight streams (20b: 29.5 MB and 23.6 MB per layer in
bf16), and cuBLAS reached 2.8 TB/s on QKV and 2.1 TB/s on O including the separate split-K reduce
kernel it launches (H200, bench/results/decode_ab_v2_gpt-oss-20b_h200.json: 10.5 us, 9.2 + 2.0 us).

grid (N blocks, K splits): each program streams one [BLOCK_N, K/S] slab of W once (tensor-core dot
against the <= 16 token rows, fp32 accumulation) and stores fp32 partial sums; the last program of
each N block to finish (a per-block atomic ticket, reset by that program) sums the S partials in a
fixed order, adds the bias and rounds once to the output dtype, as cuBLAS's bias epilogue does. No
second launch, and the result does not depend on the order the programs ran in.
Twin: torch.nn.functional.linear (same products, fp32 sums in another order).

The model runs O through it (6.4 vs cuBLAS's 9.6 us at T=1); QKV stays on cuBLAS, which measured
faster there (7.7 vs 9.3 us): H200, 2026-11-30, bench/gemv_sweep, bench/results/gemv_h200.json.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.layers import GEMV_MIN_BLOCK_N, gemv_tickets
from kernels.pdl import pdl_prologue

GEMV_MAX_TOKENS = 16
MIN_BLOCK_N = GEMV_MIN_BLOCK_N  # tickets are sized for this, so any BLOCK_N >= 16 fits them
DEFAULT_CONFIG = dict(BLOCK_N=64, BLOCK_K=128, waves=2, num_warps=4, num_stages=4)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, partial_ptr, tickets_ptr, num_tokens, n, k, k_per_split,
                 stride_x, stride_w, stride_y, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_BF16: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_prologue(PDL)
    nb, split = tl.program_id(0), tl.program_id(1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    n_ok = offs_n < n
    t_ok = offs_t < num_tokens
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, k), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)
        xt = tl.load(x_ptr + offs_t[None, :] * stride_x + offs_k[:, None], mask=t_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_BF16:
            acc = tl.dot(w, xt, acc)
        else:  # Triton's interpreter multiplies bf16 dot operands as raw integers: fp32 there
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    finish_split_k(acc, partial_ptr, tickets_ptr, b_ptr, y_ptr, nb, split, offs_n, offs_t, n, num_tokens, stride_y,
                   HAS_BIAS, BLOCK_N, BLOCK_T, SPLIT_K)


@triton.jit
def finish_split_k(acc, partial_ptr, tickets_ptr, b_ptr, y_ptr, nb, split, offs_n, offs_t, n, num_tokens, stride_y,
                   HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT_K: tl.constexpr,
                   bias=None):
    """The split-K GEMVs' epilogue: acc [BLOCK_N, BLOCK_T] holds this program's fp32 sums of y^T. With one
    split, + bias and store; else store the partial, and the last program of the N block (atomic ticket,
    reset by it) sums the S partials in a fixed order, adds the bias and rounds once. `bias`: the block's
    bias [BLOCK_N] fp32 already loaded (e.g. before the PDL wait), else it is read from b_ptr here."""
    n_ok = offs_n < n
    out_ok = n_ok[:, None] & (offs_t < num_tokens)[None, :]
    y_ptrs = y_ptr + offs_t[None, :] * stride_y + offs_n[:, None]
    if SPLIT_K == 1:  # the whole K in this program (wide N, e.g. the unembedding): no partial round trip
        if HAS_BIAS:
            if bias is None:
                acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            else:
                acc += bias[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_ok)
    else:
        slab = partial_ptr + offs_n[:, None] * BLOCK_T + offs_t[None, :]  # partial [S, N, BLOCK_T]
        tl.store(slab + split * n * BLOCK_T, acc, mask=n_ok[:, None])
        tl.debug_barrier()  # every thread's partials stored before the one thread taking the ticket releases them
        ticket = tl.atomic_add(tickets_ptr + nb, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            tl.store(tickets_ptr + nb, 0)  # ready for the next call (CUDA-graph replays included)
            total = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # fixed order
                total += tl.load(slab + s * n * BLOCK_T, mask=out_ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                if bias is None:
                    total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
                else:
                    total += bias[:, None]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_ok)


new_tickets = gemv_tickets  # per-N-block ticket counters for a projection with N outputs


def num_splits(n: int, k: int, num_sms: int, config: dict) -> tuple[int, int]:
    """(K splits, K per split): about `waves` x SMs programs, each split a whole number of BLOCK_K steps."""
    n_blocks = triton.cdiv(n, config["BLOCK_N"])
    want = max(1, min(triton.cdiv(config["waves"] * num_sms, n_blocks), triton.cdiv(k, config["BLOCK_K"])))
    per = triton.cdiv(triton.cdiv(k, want), config["BLOCK_K"]) * config["BLOCK_K"]
    return triton.cdiv(k, per), per


_SMS: dict = {}


def num_sms(device: torch.device) -> int:
    """SMs of `device` (cached; 8 for CPU tensors under Triton's interpreter): what num_splits sizes for."""
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return _SMS[device]


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tickets: torch.Tensor,
         config: dict | None = None) -> torch.Tensor:
    """x [T, K] (T <= 16) @ weight [N, K]^T + bias [N] -> [T, N] in x's dtype."""
    t, k = x.shape
    n = weight.shape[0]
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    if not 0 < t <= GEMV_MAX_TOKENS or weight.shape != (n, k) or (bias is not None and bias.shape != (n,)) \
            or tickets.numel() < triton.cdiv(n, MIN_BLOCK_N) or cfg["BLOCK_N"] < MIN_BLOCK_N:
        raise ValueError(f"gemv: x {tuple(x.shape)} (1..{GEMV_MAX_TOKENS} rows), weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)}, {tickets.numel()} tickets")
    x, weight = x.contiguous(), weight.contiguous()
    splits, per = num_splits(n, k, num_sms(x.device), cfg)
    block_t = 16
    partial = torch.empty(splits if splits > 1 else 0, n, block_t, dtype=torch.float32, device=x.device)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), splits)](
        x, weight, bias if bias is not None else weight, y, partial, tickets, t, n, k, per,
        x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_T=block_t,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=splits, DOT_BF16=x.is_cuda and x.dtype == torch.bfloat16,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl.launch(x))
    return y
