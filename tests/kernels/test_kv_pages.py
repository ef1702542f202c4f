"""Whole-page K/V copies (kernels/attention/kv_pages.py, the prefix cache's host tier): the twin on CPU, the
kernel under Triton's interpreter (subprocess), and on the GPU between device memory and pinned host memory
in both directions, against the twin."""

from __future__ import annotations

import gc

import pytest
import torch

from kernels.attention import kv_pages
from tests.kernels.interpreter import fresh_seed, run_cases  # noqa: F401  (fresh_seed: autouse, fresh random inputs)
from tests.kernels.kv_pages_common import make_pages


@pytest.mark.parametrize("n", [1, 9])
def test_twin_copies_each_page_to_its_place(n):
    srcs, dsts, src_pages, dst_pages = make_pages(n, torch.bfloat16, layers=2, src_blocks=11, dst_blocks=13)
    before = [d.clone() for d in dsts]
    kv_pages.copy_pages(srcs, src_pages, dsts, dst_pages)
    for src, dst, old in zip(srcs, dsts, before):  # (bytes: random bytes hold NaNs)
        src, dst, old = src.view(torch.uint8), dst.view(torch.uint8), old.view(torch.uint8)
        for s, d in zip(src_pages, dst_pages):
            assert torch.equal(dst[d], src[s])
        untouched = [p for p in range(dst.shape[0]) if p not in dst_pages]
        assert torch.equal(dst[untouched], old[untouched])


def test_mismatched_arguments_are_errors():
    srcs, dsts, src_pages, dst_pages = make_pages(2, torch.bfloat16, layers=1, src_blocks=4, dst_blocks=4)
    with pytest.raises(ValueError, match="sources"):
        kv_pages.copy_pages(srcs, src_pages, dsts[:1], dst_pages)
    with pytest.raises(ValueError, match="pages of"):
        kv_pages.copy_pages(srcs, src_pages, [d[:, :8] for d in dsts], dst_pages)


def test_kernel_under_the_interpreter():
    """tests/kernels/kv_pages_interpreter_cases.py: the Triton kernel against the twin."""
    run_cases("kv_pages_interpreter_cases.py")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("n", [1, 37, 1029])
def test_kernel_moves_pages_to_pinned_host_memory_and_back(n, dtype):
    """The host tier's two directions: GPU pages into pinned host slots (the kernel stores through the host
    pointers), then those slots into other GPU pages (it loads through them); bytes equal to the twin's."""
    srcs, host, src_pages, slots = make_pages(n, dtype, layers=3, src_blocks=1100, dst_blocks=1051,
                                              src_device="cuda", dst_pinned=True)
    want = [h.clone() for h in host]
    kv_pages.copy_pages(srcs, src_pages, host, slots)
    kv_pages.copy_pages_reference([s.cpu() for s in srcs], src_pages, want, slots)
    torch.cuda.synchronize()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(host, want))
    back = [torch.zeros_like(s) for s in srcs]
    pages = torch.randperm(1100)[:n].tolist()
    kv_pages.copy_pages(host, slots, back, pages)
    torch.cuda.synchronize()
    for b, s in zip(back, srcs):
        assert torch.equal(b[pages].view(torch.uint8), s[src_pages].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_a_registered_host_cache_takes_pages_and_gives_them_back(dtype):
    """The host tier's storage (PagedKVCache.allocate(pin_memory=True): one registered buffer, not torch's pinned
    allocator): the kernel runs on it (pinned as torch sees it) both ways, and it unregisters."""
    from kernels.attention import PagedKVCache

    sliding = [True, False, True]
    device = PagedKVCache.allocate(sliding, 300, 40, 16, 8, 64, dtype, "cuda")
    host = PagedKVCache.allocate(sliding, 257, 257, 16, 8, 64, dtype, "cpu", pin_memory=True)
    try:
        assert host.pinned is not None and all(t.is_pinned() for t in host.k + host.v)
        for t in device.k + device.v:
            t.view(torch.uint8).random_(0, 256)
        full = [i for i, s in enumerate(sliding) if not s]
        src = [device.k[i] for i in full] + [device.v[i] for i in full]
        dst = [host.k[i] for i in full] + [host.v[i] for i in full]
        assert kv_pages._fits_kernel(src, dst, None)
        pages, slots = torch.randperm(300)[:129].tolist(), torch.randperm(257)[:129].tolist()
        kv_pages.copy_pages(src, pages, dst, slots)
        back = [torch.zeros_like(t) for t in src]
        kv_pages.copy_pages(dst, slots, back, pages)
        torch.cuda.synchronize()
        for b, s in zip(back, src):
            assert torch.equal(b[pages].view(torch.uint8), s[pages].view(torch.uint8))
    finally:
        host.unpin()
    assert host.pinned is None
    # an engine's host tier dropped without close(): collected, it unregisters, so the next registration of the
    # same addresses works (before, the second failed: cudaErrorHostMemoryAlreadyRegistered)
    for _ in range(3):
        dropped = PagedKVCache.allocate(sliding, 257, 257, 16, 8, 64, dtype, "cpu", pin_memory=True)
        assert dropped.k[0].is_pinned()
        del dropped
        gc.collect()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_pageable_host_memory_takes_the_twin():
    """The kernel cannot address pageable host memory: such a destination is copied by the twin (correct, slow)."""
    srcs, host, src_pages, slots = make_pages(5, torch.bfloat16, layers=1, src_blocks=8, dst_blocks=8,
                                              src_device="cuda")
    assert not kv_pages._fits_kernel(srcs, host, None)
    kv_pages.copy_pages(srcs, src_pages, host, slots)
    for h, s in zip(host, srcs):
        assert torch.equal(h[slots].view(torch.uint8), s[src_pages].cpu().view(torch.uint8))


def test_without_a_driver_host_pointers_are_not_assumed_readable():
    """No libcuda (this CPU machine) or no such device: the answer is False (the torch path), not an error."""
    if torch.cuda.is_available():
        pytest.skip("a driver is present: the GPU test below asks it")
    assert kv_pages.kernels_read_host_pointers(0) is False
    assert kv_pages.kernels_read_host_pointers(10_000) is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_device_that_cannot_use_host_pointers_takes_the_twin(monkeypatch):
    """The H100 / H200 hosts report CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM; where a device does not, pinned
    pages go through the twin (the kernel would fault), with the same bytes."""
    assert kv_pages.kernels_read_host_pointers(torch.cuda.current_device()) is True
    srcs, host, src_pages, slots = make_pages(7, torch.bfloat16, layers=2, src_blocks=9, dst_blocks=11,
                                              src_device="cuda", dst_pinned=True)
    assert kv_pages._fits_kernel(srcs, host, None)
    monkeypatch.setattr(kv_pages, "kernels_read_host_pointers", lambda index: False)
    assert not kv_pages._fits_kernel(srcs, host, None)
    kv_pages.copy_pages(srcs, src_pages, host, slots)
    torch.cuda.synchronize()
    for h, s in zip(host, srcs):
        assert torch.equal(h[slots].view(torch.uint8), s[src_pages].cpu().view(torch.uint8))
