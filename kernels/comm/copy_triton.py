"""A byte copy done by SM loads and stores (Triton), for copies whose destination is another GPU's memory.

The copy engine moves a cross-GPU `copy_` by DMA; a kernel on the source GPU can instead store straight
into a peer's memory mapped into this process (CUDA IPC, peer access enabled), with as many SMs as it
likes. `bench/kv_transfer.py --send-modes sm_copy` compares the two for the K/V hand-off.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK = 2048  # int64 words per program and step: 16 KiB


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n_words, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    for base in range(start, n_words, step):
        idx = base + tl.arange(0, BLOCK)
        mask = idx < n_words
        tl.store(dst_ptr + idx, tl.load(src_ptr + idx, mask=mask), mask=mask)


def copy_bytes(src: torch.Tensor, dst: torch.Tensor, programs: int | None = None) -> None:
    """dst[:] = src for two contiguous uint8 tensors of the same length (a multiple of 8, 8-byte aligned),
    launched on src's device; dst may live on a peer GPU."""
    if src.numel() != dst.numel() or src.numel() % 8 or src.data_ptr() % 8 or dst.data_ptr() % 8:
        raise ValueError(f"copy_bytes needs equal, 8-byte aligned lengths, got {src.numel()} and {dst.numel()}")
    n = src.numel() // 8
    if n == 0:
        return
    if programs is None:
        programs = 4 * torch.cuda.get_device_properties(src.device).multi_processor_count if src.is_cuda else 4
    grid = (max(1, min(programs, triton.cdiv(n, BLOCK))),)
    with torch.cuda.device(src.device) if src.is_cuda else contextlib.nullcontext():
        _copy_kernel[grid](src.view(torch.int64), dst.view(torch.int64), n, BLOCK=BLOCK, num_warps=8)

