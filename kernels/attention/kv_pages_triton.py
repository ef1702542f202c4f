"""The Triton kernel behind kernels/attention/kv_pages.py (imported only where a launch needs it)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_pages(meta_ptr, n_entries, PAGE_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    """Entry e = program_id(0): meta holds a source page address, then a destination page address, as two
    int64 columns of n_entries each (device memory, or pinned host memory the GPU addresses directly). Program
    (e, c) copies words c * BLOCK .. (c + 1) * BLOCK - 1 of the page's PAGE_WORDS 8-byte words."""
    e = tl.program_id(0)
    src = tl.load(meta_ptr + e).to(tl.pointer_type(tl.int64))
    dst = tl.load(meta_ptr + n_entries + e).to(tl.pointer_type(tl.int64))
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PAGE_WORDS
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
