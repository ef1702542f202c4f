"""Whole K/V pages copied between caches of one layout: the prefix cache's host tier (engine/host_kv_tier.py)
moves evicted pages of the GPU cache to slots of a host copy of it and back.

`copy_pages(srcs, src_pages, dsts, dst_pages)`: for every layer i and every j, dsts[i][dst_pages[j]] =
srcs[i][src_pages[j]] (pages [block_size, kv_heads, head_dim], any dtype: bytes are copied).

On CUDA one Triton launch does all of it: program (layer x page, chunk) copies 8-byte words from one page's
address to the other's. A host tier's tensors are in pinned memory, which the GPU addresses directly (unified
virtual addressing: a pinned allocation's host pointer is valid in kernels), so the launch reads or writes host
memory over PCIe itself: no staging buffer, no per-page copy calls (a 512-page move of 120b's 36 layers would
be 36,864 of them). The torch twin (`copy_pages_reference`, index_select / index_copy_ per layer) is the CPU path
and what the tests compare against.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import numpy as np
import torch

BLOCK_WORDS = 1024


def _page_words(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size() // 8 if t.shape[0] else 0


def copy_pages_reference(srcs: list[torch.Tensor], src_pages, dsts: list[torch.Tensor], dst_pages) -> None:
    src_idx = torch.as_tensor(np.asarray(src_pages, dtype=np.int64))
    dst_idx = torch.as_tensor(np.asarray(dst_pages, dtype=np.int64))
    for src, dst in zip(srcs, dsts):
        rows = src.view(torch.uint8).index_select(0, src_idx.to(src.device))
        dst.view(torch.uint8).index_copy_(0, dst_idx.to(dst.device), rows.to(dst.device))


CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91  # (cuda.h's CUdevice_attribute)


@functools.cache
def kernels_read_host_pointers(device_index: int) -> bool:
    """Whether kernels on CUDA device `device_index` may dereference a registered host allocation at its host
    address (the driver's CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM; true on x86 Linux hosts with unified
    addressing, as on the H100 / H200 machines seen). Where it is false the kernel would fault, so page copies
    that touch pinned host memory take the torch path (copy_pages_reference) there. False without a driver."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    device, value = ctypes.c_int(), ctypes.c_int()
    if driver.cuInit(0) or driver.cuDeviceGet(ctypes.byref(device), device_index):
        return False
    if driver.cuDeviceGetAttribute(ctypes.byref(value), CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                                   device):
        return False
    return value.value == 1


def _fits_kernel(srcs: list[torch.Tensor], dsts: list[torch.Tensor], use_kernel: bool | None) -> bool:
    """use_kernel None: the kernel where a CUDA tensor is involved and every tensor is CUDA or pinned; True also
    on CPU tensors (Triton's interpreter, tests/kernels/kv_pages_interpreter_cases.py)."""
    tensors = [*srcs, *dsts]
    if not tensors or use_kernel is False:
        return False
    if use_kernel is None:
        cuda = next((t.device for t in tensors if t.is_cuda), None)
        if cuda is None or not all(t.is_cuda or t.is_pinned() for t in tensors):
            return False
        if not all(t.is_cuda for t in tensors) and not kernels_read_host_pointers(cuda.index):
            return False
    words = _page_words(srcs[0])
    return words > 0 and all(t.is_contiguous() and t.data_ptr() % 8 == 0 and _page_words(t) == words
                             for t in tensors)


def copy_pages(srcs: list[torch.Tensor], src_pages, dsts: list[torch.Tensor], dst_pages,
               use_kernel: bool | None = None) -> None:
    """dsts[i][dst_pages[j]] <- srcs[i][src_pages[j]] (whole pages; page shapes and byte sizes must agree).
    Queued on the current stream of the CUDA device involved; nothing waits for it."""
    if len(srcs) != len(dsts) or len(src_pages) != len(dst_pages):
        raise ValueError(f"copy_pages: {len(srcs)} sources for {len(dsts)} destinations, {len(src_pages)} pages "
                         f"for {len(dst_pages)}")
    for src, dst in zip(srcs, dsts):
        if src[0].numel() * src.element_size() != dst[0].numel() * dst.element_size():
            raise ValueError(f"copy_pages: pages of {tuple(src.shape[1:])} {src.dtype} into pages of "
                             f"{tuple(dst.shape[1:])} {dst.dtype}")
    if not len(src_pages) or not srcs:
        return
    if not _fits_kernel(srcs, dsts, use_kernel):
        copy_pages_reference(srcs, src_pages, dsts, dst_pages)
        return
    import triton

    from kernels.attention import kv_pages_triton as tk

    words = _page_words(srcs[0])
    page_bytes = words * 8
    src_pages = np.asarray(src_pages, dtype=np.int64)
    dst_pages = np.asarray(dst_pages, dtype=np.int64)
    src_base = np.asarray([t.data_ptr() for t in srcs], dtype=np.int64)
    dst_base = np.asarray([t.data_ptr() for t in dsts], dtype=np.int64)
    meta = np.concatenate([(src_base[:, None] + src_pages[None, :] * page_bytes).ravel(),
                           (dst_base[:, None] + dst_pages[None, :] * page_bytes).ravel()])
    cuda = next((t.device for t in (*srcs, *dsts) if t.is_cuda), None)
    meta_t = torch.from_numpy(meta)
    if cuda is not None:
        meta_t = meta_t.pin_memory().to(cuda, non_blocking=True)
    n = len(srcs) * len(src_pages)
    grid = (n, -(-words // BLOCK_WORDS))
    with torch.cuda.device(cuda) if cuda is not None else contextlib.nullcontext():
        tk.copy_pages[grid](meta_t, n, PAGE_WORDS=words, BLOCK=min(BLOCK_WORDS, triton.next_power_of_2(words)),
                            num_warps=4)
