"""Paged K/V storage: one pool of pages for full-attention layers, one for sliding-window layers."""

from __future__ import annotations

import mmap
import weakref
from dataclasses import dataclass

import torch


@dataclass
class PagedKVCache:
    """Per layer, K and V pages [num_blocks, block_size, kv_heads, head_dim] (FlashInfer's NHD layout).

    Layers of one kind share page ids: page p of sequence s is p in every full layer's tensor (or in
    every sliding layer's tensor), so one table per kind serves all its layers."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int
    num_full_blocks: int
    num_sliding_blocks: int
    pinned: "RegisteredHostBuffer | None" = None  # the registered host buffer behind a pin_memory cache

    @staticmethod
    def allocate(
        layer_is_sliding: list[bool],
        num_full_blocks: int,
        num_sliding_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pin_memory: bool = False,
    ) -> "PagedKVCache":
        """pin_memory: one uninitialized host buffer, page-locked (registered with CUDA, so GPU kernels address it
        directly), its views the pages (a host tier's copy of a GPU cache); `unpin` releases it. Else zeros."""
        shapes = [(num_sliding_blocks if sliding else num_full_blocks, block_size, kv_heads, head_dim)
                  for sliding in layer_is_sliding for _ in "kv"]
        if not pin_memory:
            tensors = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
            return PagedKVCache(tensors[0::2], tensors[1::2], block_size, num_full_blocks, num_sliding_blocks)
        # Registered rather than torch's pinned allocator, which may round a request up to a power of two.
        sizes = [int(torch.Size(shape).numel()) for shape in shapes]
        buffer = RegisteredHostBuffer(sum(sizes), dtype)
        tensors = [part.view(shape) for part, shape in zip(buffer.tensor.split(sizes), shapes)]
        cache = PagedKVCache(tensors[0::2], tensors[1::2], block_size, num_full_blocks, num_sliding_blocks)
        cache.pinned = buffer
        return cache

    def unpin(self) -> None:
        if self.pinned is not None:
            self.pinned.release()
            self.pinned = None

    @staticmethod
    def bytes_per_block(num_layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one page id costs across `num_layers` layers (K and V)."""
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class RegisteredHostBuffer:
    """A host tensor page-locked and mapped for the GPUs (cudaHostRegister, portable + mapped), unregistered before
    its memory can be freed: by `release()`, or when the buffer is collected (the finalizer holds the tensor until
    then). A range freed while registered stays registered with CUDA, and the next buffer given those addresses
    cannot register (cudaErrorHostMemoryAlreadyRegistered: two engines one after another in one process, on the
    H200, 2026-12-05).

    The memory is an anonymous mapping advised MADV_HUGEPAGE (2 MB pages where transparent huge pages are on or
    `madvise`, as on the GPU hosts seen), zeroed on torch's threads before registration, so the pages fault in
    in parallel and registration pins already-present pages: 32 GiB in 1.97 s against 14.04 s for torch.empty +
    registration, which faults 4 kB pages one by one (bench.host_register_probe, 2026-12-05; 16 threads). The
    buffer therefore starts zeroed."""

    def __init__(self, numel: int, dtype: torch.dtype):
        nbytes = numel * dtype.itemsize
        if not nbytes:
            self.tensor = torch.empty(0, dtype=dtype)
        else:
            mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    mapping.madvise(mmap.MADV_HUGEPAGE)
                except OSError:  # (a kernel without transparent huge pages: 4 kB pages, slower to fault in)
                    pass
            # (the tensor holds the mapping: it is unmapped when the tensor is freed, after _unregister)
            self.tensor = torch.frombuffer(mapping, dtype=dtype)
            del mapping
            self.tensor.zero_()
            error = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 3))
            if error:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: cudaError {error}")
        self._finalizer = weakref.finalize(self, _unregister, self.tensor)
        self._finalizer.atexit = False  # (a process that exits frees its registrations)

    def release(self) -> None:
        self._finalizer()


def _unregister(t: torch.Tensor) -> None:
    if t.numel():
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


# KV cache element types: "auto" stores K/V in the model's dtype (bf16 on the GPU: what the reference
# computes with); "fp8_e4m3" stores float8_e4m3fn, unscaled (|K|, |V| saturate at 448), half the bytes:
# twice the tokens in the same memory and half the bytes a decode step reads, at ~2^-4 relative rounding
# of every cached K/V element (attention outputs then differ from the bf16 cache's by ~1e-2).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3")


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return {"auto": model_dtype, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache [num_blocks, block, H, D] at flat token slots <- rows [n, H, D], converted to the cache dtype
    (index_copy_ has no float8 kernel on CPU: fp8 caches copy bytes)."""
    flat = cache.view(-1, *cache.shape[2:])
    src = rows.to(cache.device, cache.dtype)
    if is_fp8(cache.dtype):
        flat, src = flat.view(torch.uint8), src.view(torch.uint8)
    flat.index_copy_(0, slots, src)
