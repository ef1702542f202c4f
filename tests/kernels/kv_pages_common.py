"""Inputs for the page-copy tests (kernels/attention/kv_pages.py): per layer a source and a destination cache
of pages [block, kv_heads, head_dim] holding random bytes, and distinct page numbers on either side."""

from __future__ import annotations

import torch


def make_pages(n: int, dtype: torch.dtype, layers: int, src_blocks: int, dst_blocks: int, block: int = 16,
               heads: int = 8, dim: int = 64, src_device="cpu", dst_device="cpu", dst_pinned: bool = False):
    def cache(blocks: int, device, pinned: bool = False) -> torch.Tensor:
        t = torch.empty(blocks, block, heads, dim, dtype=dtype, pin_memory=pinned) if pinned else \
            torch.empty(blocks, block, heads, dim, dtype=dtype, device=device)
        t.view(torch.uint8).random_(0, 256)
        return t

    srcs = [cache(src_blocks, src_device) for _ in range(2 * layers)]
    dsts = [cache(dst_blocks, dst_device, dst_pinned) for _ in range(2 * layers)]
    src_pages = torch.randperm(src_blocks)[:n].tolist()
    dst_pages = torch.randperm(dst_blocks)[:n].tolist()
    return srcs, dsts, src_pages, dst_pages
