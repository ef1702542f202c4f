"""The Triton kernel behind kernels/attention/kv_rows.py (imported only where a CUDA tensor needs it)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_rows(meta_ptr, slots_ptr, n_entries, SCATTER: tl.constexpr, ROW_WORDS: tl.constexpr,
              BLOCK_ROWS: tl.constexpr):
    """Entry e = program_id(0): meta holds, per entry, [cache pointer, rows pointer, first slot index,
    row count, pad] as five int64 columns of n_entries each. Gather: rows[r] = cache[slot[r]]; scatter:
    cache[slot[r]] = 0 for r < pad, else rows[r - pad]. Rows are ROW_WORDS 8-byte words."""
    e = tl.program_id(0)
    cache = tl.load(meta_ptr + e).to(tl.pointer_type(tl.int64))
    rows = tl.load(meta_ptr + n_entries + e).to(tl.pointer_type(tl.int64))
    first = tl.load(meta_ptr + 2 * n_entries + e)
    count = tl.load(meta_ptr + 3 * n_entries + e)
    r = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = r < count
    slot = tl.load(slots_ptr + first + r, mask=live, other=0)
    words = tl.arange(0, ROW_WORDS)
    cache_at = cache + slot[:, None] * ROW_WORDS + words[None, :]
    mask = live[:, None]
    if SCATTER:
        pad = tl.load(meta_ptr + 4 * n_entries + e)
        src = r - pad
        data = tl.load(rows + src[:, None] * ROW_WORDS + words[None, :], mask=mask & (src >= 0)[:, None], other=0)
        tl.store(cache_at, data, mask=mask)
    else:
        tl.store(rows + r[:, None] * ROW_WORDS + words[None, :], tl.load(cache_at, mask=mask), mask=mask)
