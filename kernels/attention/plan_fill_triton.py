"""The decode step's metadata into the backend's fixed buffers in one launch (both layer kinds).

`StepBuffers.fill` (gpu_plan.py) is five torch ops per layer kind (three copies, a zero and a fill for the rows
past the step): ten small launches of ~1 us each on the stream before every decode step, which at batch 1 sit
between the CUDA-graph replays (bench.engine_step_profile, H200 2026-12-03: 8 device-to-device copies, 4 fills and
an arange per step). This kernel does what those do, for every kind in one grid: row r < n copies the step's
table row (its `cols` columns; columns past them keep stale pages, which the kernels never read past
ceil(kv_len / page)), kv_len and slot; rows n .. capacity get kv_len 0 and slot -1 (rows a larger captured graph
still covers must do nothing). The same launch can copy two more 1-D arrays (the decode graphs' token ids and
positions, two more device-to-device copies otherwise). Twin: StepBuffers.fill (and Tensor.copy_).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.gpu_plan import StepBuffers
from kernels.attention.metadata import KVGroupMeta

BLOCK_C = 1024  # table columns per inner step


@triton.jit
def _fill_group(src_t, src_l, src_s, dst_t, dst_l, dst_s, row, n, cols, stride_src, stride_dst, rows_cap, slots_cap,
                BLOCK_C: tl.constexpr):
    live = row < n
    if row < rows_cap:
        length = tl.load(src_l + row, mask=live, other=0)
        tl.store(dst_l + row, length)
    if row < slots_cap:
        slot = tl.load(src_s + row, mask=live, other=-1)
        tl.store(dst_s + row, slot)
    if live:
        src = src_t + row.to(tl.int64) * stride_src
        dst = dst_t + row.to(tl.int64) * stride_dst
        for c0 in range(0, cols, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            tl.store(dst + c, tl.load(src + c, mask=c < cols), mask=c < cols)


# The step's table widths, batch and row counts change from step to step: specializing on them ("divisible by 16 /
# equal to 1 / other") would compile new variants mid-run (a decode step crossing a 16-page width did: 2.106 against
# 1.716 ms per token through the engine on the H200, 2026-12-03, before this list).
@triton.jit(do_not_specialize=["cols0", "stride_src0", "cols1", "stride_src1", "n", "len_r0", "len_r1"])
def _fill_kernel(src_t0, src_l0, src_s0, dst_t0, dst_l0, dst_s0, cols0, stride_src0, stride_dst0, rows_cap0,
                 slots_cap0, src_t1, src_l1, src_s1, dst_t1, dst_l1, dst_s1, cols1, stride_src1, stride_dst1,
                 rows_cap1, slots_cap1, n, src_r0, dst_r0, len_r0, src_r1, dst_r1, len_r1, NUM_ROWS: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    row, kind = tl.program_id(0), tl.program_id(1)
    if kind == 0:  # the plain row copies (`rows`) ride on the first kind's programs
        if NUM_ROWS > 0:
            if row < len_r0:
                tl.store(dst_r0 + row, tl.load(src_r0 + row))
        if NUM_ROWS > 1:
            if row < len_r1:
                tl.store(dst_r1 + row, tl.load(src_r1 + row))
        _fill_group(src_t0, src_l0, src_s0, dst_t0, dst_l0, dst_s0, row, n, cols0, stride_src0, stride_dst0,
                    rows_cap0, slots_cap0, BLOCK_C)
    else:
        _fill_group(src_t1, src_l1, src_s1, dst_t1, dst_l1, dst_s1, row, n, cols1, stride_src1, stride_dst1,
                    rows_cap1, slots_cap1, BLOCK_C)


def fill_decode_buffers(pairs: list[tuple[StepBuffers, KVGroupMeta]], num_seqs: int,
                        rows: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()) -> None:
    """Each (buffers, step meta) pair as StepBuffers.fill(meta, num_seqs) does it (a decode step: one token per
    sequence), all in one launch. One or two pairs. rows: up to two (src, dst) pairs of 1-D tensors of one dtype,
    dst[:len(src)] = src in the same launch (the decode graphs' token ids and positions)."""
    if not 1 <= len(pairs) <= 2 or len(rows) > 2:
        raise ValueError(f"fill_decode_buffers takes one or two layer kinds and at most two row copies, got "
                         f"{len(pairs)} and {len(rows)}")
    for src, dst in rows:
        if src.dim() != 1 or dst.dim() != 1 or src.dtype != dst.dtype or src.numel() > dst.numel() \
                or dst.stride(0) != 1:
            raise ValueError(f"a row copy needs 1-D tensors of one dtype into a contiguous one no shorter: got "
                             f"{tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}")
    rows = tuple((src if src.stride(0) == 1 else src.contiguous(), dst) for src, dst in rows)
    args, grid_rows = [], 0
    for buffers, meta in pairs:
        batch, cols = meta.block_tables.shape
        max_batch, max_blocks = buffers.block_tables.shape
        if batch != num_seqs or meta.kv_lens.numel() != num_seqs or meta.slot_mapping.numel() != num_seqs:
            raise ValueError(f"a decode step of {num_seqs} sequences has {batch} table rows, "
                             f"{meta.kv_lens.numel()} lengths and {meta.slot_mapping.numel()} slots")
        if batch > max_batch or cols > max_blocks or num_seqs > buffers.slot_mapping.numel():
            raise ValueError(
                f"step of {batch} sequences x {cols} pages, {num_seqs} tokens exceeds the backend's buffers "
                f"({max_batch} x {max_blocks}, {buffers.slot_mapping.numel()}); raise max_batch / max_kv_len")
        if meta.block_tables.stride(1) != 1 or buffers.block_tables.stride(1) != 1:
            raise ValueError("page tables need unit stride along their columns")
        args.append((meta.block_tables, meta.kv_lens, meta.slot_mapping, buffers.block_tables, buffers.kv_lens,
                     buffers.slot_mapping, cols, meta.block_tables.stride(0), buffers.block_tables.stride(0),
                     max_batch, buffers.slot_mapping.numel()))
        grid_rows = max(grid_rows, max_batch, buffers.slot_mapping.numel())
    kinds = len(args)
    if kinds == 1:
        args.append(args[0])
    copies = [(src, dst, src.numel()) for src, dst in rows]
    grid_rows = max([grid_rows] + [c[2] for c in copies])
    copies += [(args[0][1], args[0][1], 0)] * (2 - len(copies))  # (unused)
    _fill_kernel[(grid_rows, kinds)](*args[0], *args[1], num_seqs, *copies[0], *copies[1], NUM_ROWS=len(rows),
                                     BLOCK_C=BLOCK_C, num_warps=4)
