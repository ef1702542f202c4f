"""Row-wise argmax of logits in one launch: the sampler's greedy pick.

torch's argmax over one row of gpt-oss's 201,088 logits is a single-block reduction plus a memset for its
semaphores: 8.0 us + 0.9 us on the H200, both between the decode step's CUDA-graph replays (bench.engine_step_profile,
2026-12-03), the largest item there. Here programs of BLOCK logits each reduce a chunk to (value, first index; the
value NaN where the chunk has one), and the last program of a row to finish (an atomic ticket per row, reset by it)
picks among the row's chunks the same way. Same result as torch.argmax(dim=-1): the first index of the largest value, or of the first NaN when the row
has one (torch treats NaN as the largest); a row of -inf gives index 0. Twin: torch.argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # logits per program: 50 programs per row of 201,088


@triton.jit
def _chunk_pick(v, idx, ok):
    """(value, first index) of the valid entries of v: NaN wins, then the largest value, then the first."""
    nan = (v != v) & ok
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    finite = tl.where(ok & ~nan, v, float("-inf"))
    best = tl.max(finite, axis=0)
    big = 2147483647
    first_nan = tl.min(tl.where(nan, idx, big), axis=0)
    first_best = tl.min(tl.where(ok & (finite == best), idx, big), axis=0)
    return tl.where(any_nan, float("nan"), best), tl.where(any_nan, first_nan, first_best)


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, part_v_ptr, part_i_ptr, tickets_ptr, vocab, stride_x,
                   CHUNKS: tl.constexpr, CHUNKS_POW2: tl.constexpr, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < vocab
    v = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
    best, first = _chunk_pick(v, offs, ok)
    part = row * CHUNKS + chunk
    tl.store(part_v_ptr + part, best)  # NaN where the chunk has one
    tl.store(part_i_ptr + part, first)
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr + row, 1, sem="acq_rel")
    if ticket == CHUNKS - 1:  # the row's last chunk: the same pick over its chunks (their indices grow with them)
        tl.store(tickets_ptr + row, 0)
        c = tl.arange(0, CHUNKS_POW2)
        c_ok = c < CHUNKS
        pv = tl.load(part_v_ptr + row * CHUNKS + c, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(part_i_ptr + row * CHUNKS + c, mask=c_ok, other=0, cache_modifier=".cg")
        _, pick = _chunk_pick(pv, pi, c_ok)
        tl.store(out_ptr + row, pick.to(tl.int64))


class RowArgmax:
    """argmax(dim=-1) of [B, V] logits (fp32 / bf16 / fp16, unit stride along V) as int64 [B]; owns the per-row
    tickets (zero between calls), grown to the largest batch seen."""

    def __init__(self, device: torch.device | str):
        self.tickets = torch.zeros(0, dtype=torch.int32, device=device)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        rows, vocab = logits.shape
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
        if rows == 0 or vocab == 0:
            return logits.argmax(dim=-1) if vocab == 0 else out
        if self.tickets.numel() < rows:
            self.tickets = torch.zeros(max(rows, 2 * self.tickets.numel()), dtype=torch.int32, device=logits.device)
        chunks = triton.cdiv(vocab, BLOCK)
        part_v = torch.empty(rows * chunks, dtype=torch.float32, device=logits.device)
        part_i = torch.empty(rows * chunks, dtype=torch.int32, device=logits.device)
        _argmax_kernel[(rows, chunks)](logits, out, part_v, part_i, self.tickets, vocab, logits.stride(0),
                                       CHUNKS=chunks, CHUNKS_POW2=triton.next_power_of_2(chunks), BLOCK=BLOCK,
                                       num_warps=4)
        return out
