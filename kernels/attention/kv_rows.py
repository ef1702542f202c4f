"""Moving a request's K/V between the paged cache and per-layer row tensors, every layer in one launch.

A K/V hand-off reads (prefill side) or writes (decode side) the rows of one request in every layer's K
and V pages: 2 x 36 tensors for gpt-oss-120b. Done as one `index_select` / `index_copy_` per tensor that
was 72 launches plus 72 allocations, ~4.6 ms of host time on the prefill side and ~1.9 ms on the decode
side per 8k-token hand-off on an H200 host (`python -m bench.disaggregated --profile-export`, 2026-11-30),
more than the bytes take over NVLink. Here one Triton launch walks a table of (cache, rows, slots)
entries: program (entry, block of rows) copies whole rows (kv_heads x head_dim elements) by 8-byte words.

- `gather_rows(caches, slots, outs)`: outs[i][r] = caches[i] at flat slot slots[i][r]. The outputs may be
  a peer GPU's memory mapped into this process (the CUDA IPC transport's slot): the stores then cross
  NVLink directly. Host outputs of a GPU cache are gathered on the GPU and copied over.
- `scatter_rows(caches, slots, srcs, pads)`: caches[i] at flat slot slots[i][r] = 0 for r < pads[i], else
  srcs[i][r - pads[i]] (the decode side's sliding layers start their first page with masked positions,
  written as zeros: engine/runner.py).

The torch twins (`gather_rows_reference`, `scatter_rows_reference`) are the CPU path and what the tests
compare against; the kernel runs for CUDA tensors whose rows are a power-of-two number of 8-byte words
(gpt-oss: 8 x 64 bf16 = 128 words; fp8 caches 64; TP shards of heads keep the power of two), others take
the twin.
"""

from __future__ import annotations

import contextlib

import torch

from kernels.attention.kv_cache import store_rows

BLOCK_ROWS = 16


def _row_words(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size() // 8 if t.dim() and t.shape[0] else 0


def empty_rows(shapes: list[tuple[int, ...]], dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Uninitialized tensors of these shapes as views of one allocation (one allocator call, not 72)."""
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    flat = torch.empty(sum(sizes), dtype=dtype, device=device)
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]


def pad_rows(rows: torch.Tensor, pad: int) -> torch.Tensor:
    """`pad` zero rows, then rows."""
    return torch.cat([rows.new_zeros(pad, *rows.shape[1:]), rows]) if pad else rows


def gather_rows_reference(caches: list[torch.Tensor], slots: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    for cache, idx, out in zip(caches, slots, outs):
        flat = cache.view(-1, *cache.shape[2:])
        torch.index_select(flat.view(torch.uint8), 0, idx, out=out.view(torch.uint8))


def scatter_rows_reference(caches: list[torch.Tensor], slots: list[torch.Tensor], srcs: list[torch.Tensor],
                           pads: list[int]) -> None:
    for cache, idx, src, pad in zip(caches, slots, srcs, pads):
        store_rows(cache, idx, pad_rows(src, pad))


def _fits_kernel(caches: list[torch.Tensor], rows: list[torch.Tensor], use_kernel: bool | None) -> bool:
    """use_kernel None: the kernel for CUDA tensors it can copy; True also on CPU tensors (Triton's
    interpreter, tests/kernels/kv_rows_interpreter_cases.py)."""
    if not caches or use_kernel is False or (use_kernel is None and not caches[0].is_cuda):
        return False
    words = _row_words(caches[0].view(-1, *caches[0].shape[2:]))
    return (words > 0 and words & (words - 1) == 0
            and all(c.is_contiguous() and c.element_size() == caches[0].element_size() for c in caches)
            and all(r.is_contiguous() and r.data_ptr() % 8 == 0 and r.element_size() == caches[0].element_size()
                    for r in rows))


def _launch(caches, slots, rows, pads, scatter: bool) -> None:
    """One launch over every (cache, slots, rows) entry; the tables travel in one host-to-device copy."""
    from kernels.attention import kv_rows_triton as tk

    n = len(caches)
    counts = [int(s.numel()) for s in slots]
    if not sum(counts):
        return
    device = caches[0].device
    # entries share slot tensors (one per layer kind): each distinct one is copied once
    distinct: dict[int, int] = {}
    parts, total = [], 0
    for s in slots:
        if id(s) not in distinct:
            distinct[id(s)] = total
            parts.append(s.to(device=device, dtype=torch.int64))
            total += s.numel()
    starts = [distinct[id(s)] for s in slots]
    meta = torch.tensor([c.data_ptr() for c in caches] + [r.data_ptr() for r in rows] + starts + counts
                        + list(pads), dtype=torch.int64).to(device, non_blocking=True)
    all_slots = torch.cat(parts) if len(parts) > 1 else parts[0]
    words = _row_words(caches[0].view(-1, *caches[0].shape[2:]))
    grid = (n, -(-max(counts) // BLOCK_ROWS))
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        tk.copy_rows[grid](meta, all_slots, n, SCATTER=scatter, ROW_WORDS=words, BLOCK_ROWS=BLOCK_ROWS,
                           num_warps=4)


def gather_rows(caches: list[torch.Tensor], slots: list[torch.Tensor], outs: list[torch.Tensor],
                use_kernel: bool | None = None) -> None:
    """outs[i] [len(slots[i]), H, D] <- caches[i] [blocks, block_size, H, D] at flat slots (same dtype)."""
    for cache, idx, out in zip(caches, slots, outs):
        if out.shape[0] != idx.numel() or out.shape[1:] != cache.shape[2:] or out.dtype != cache.dtype:
            raise ValueError(f"gather_rows: rows {tuple(out.shape)} {out.dtype} for {idx.numel()} slots of a "
                             f"{tuple(cache.shape)} {cache.dtype} cache")
    if caches and caches[0].is_cuda and not all(o.is_cuda for o in outs):
        # host destinations (a caller's pinned staging buffers, say): the kernel cannot store there, and
        # index_select will not write across devices; gather on the device, then copy the rows over
        staged = empty_rows([tuple(o.shape) for o in outs], caches[0].dtype, caches[0].device)
        gather_rows(caches, slots, staged, use_kernel)
        for out, rows in zip(outs, staged):
            out.copy_(rows)
        return
    if _fits_kernel(caches, outs, use_kernel):
        _launch(caches, slots, outs, [0] * len(caches), scatter=False)
    else:
        gather_rows_reference(caches, slots, outs)


def scatter_rows(caches: list[torch.Tensor], slots: list[torch.Tensor], srcs: list[torch.Tensor],
                 pads: list[int], use_kernel: bool | None = None) -> None:
    """caches[i] at flat slots[i] <- pads[i] zero rows, then srcs[i] [n, H, D] (same dtype as the cache)."""
    for cache, idx, src, pad in zip(caches, slots, srcs, pads):
        if src.shape[0] + pad != idx.numel() or src.shape[1:] != cache.shape[2:] or src.dtype != cache.dtype:
            raise ValueError(f"scatter_rows: {pad} pad + {tuple(src.shape)} {src.dtype} rows for {idx.numel()} "
                             f"slots of a {tuple(cache.shape)} {cache.dtype} cache")
    if _fits_kernel(caches, srcs, use_kernel) and all(s.device == caches[0].device for s in srcs):
        _launch(caches, slots, srcs, pads, scatter=True)
    else:
        scatter_rows_reference(caches, slots, srcs, pads)
