"""K/V row gather / scatter (kernels/attention/kv_rows.py): the twins on CPU, the kernel under Triton's
interpreter (subprocess), and on the GPU against the twins."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import kv_rows
from tests.kernels.interpreter import run_cases
from tests.kernels.kv_rows_common import make_case


@pytest.mark.parametrize("rows", [1, 130])
def test_twins_gather_what_they_scatter(rows):
    caches, slots, pads = make_case(rows, torch.bfloat16, layers=2)
    srcs = [torch.randn(s.numel() - p, *c.shape[2:]).to(c.dtype) for c, s, p in zip(caches, slots, pads)]
    kv_rows.scatter_rows(caches, slots, srcs, pads)
    outs = [torch.empty(s.numel(), *c.shape[2:], dtype=c.dtype) for c, s in zip(caches, slots)]
    kv_rows.gather_rows(caches, slots, outs)
    for out, src, pad in zip(outs, srcs, pads):
        assert torch.equal(out[pad:], src) and not out[:pad].any()


def test_shapes_are_checked():
    caches, slots, pads = make_case(4, torch.bfloat16, layers=1)
    with pytest.raises(ValueError, match="gather_rows"):
        kv_rows.gather_rows(caches, slots, [torch.empty(3, 8, 64, dtype=torch.bfloat16)] * 2)
    with pytest.raises(ValueError, match="scatter_rows"):
        kv_rows.scatter_rows(caches, slots, [torch.empty(4, 8, 64, dtype=torch.float32)] * 2, pads)


def test_kernel_under_the_interpreter():
    """tests/kernels/kv_rows_interpreter_cases.py: the Triton kernel against the twins."""
    run_cases("kv_rows_interpreter_cases.py")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows", [1, 127, 4099])
def test_kernel_on_the_gpu(rows, dtype):
    caches, slots, pads = make_case(rows, dtype, layers=4, device="cuda")
    outs = [torch.empty(s.numel(), *c.shape[2:], dtype=dtype, device="cuda") for c, s in zip(caches, slots)]
    want = [torch.empty_like(o) for o in outs]
    kv_rows.gather_rows(caches, slots, outs)
    kv_rows.gather_rows_reference(caches, slots, want)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(outs, want))
    srcs = [o[p:].clone() for o, p in zip(outs, pads)]
    got, expect = [torch.zeros_like(c) for c in caches], [torch.zeros_like(c) for c in caches]
    kv_rows.scatter_rows(got, slots, srcs, pads)
    kv_rows.scatter_rows_reference(expect, slots, srcs, pads)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, expect))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_cache_rows_into_host_tensors():
    """A caller may supply host destinations (export_kv's `into`): the rows arrive there, nothing faults
    (before 2026-12-01 the kernel stored through host pointers: an illegal address that killed the context)."""
    caches, slots, _ = make_case(300, torch.bfloat16, layers=3, device="cuda")
    outs = [torch.full((s.numel(), *c.shape[2:]), float("nan"), dtype=torch.bfloat16) for c, s in zip(caches, slots)]
    want = [torch.empty(o.shape, dtype=o.dtype, device="cuda") for o in outs]
    kv_rows.gather_rows(caches, slots, outs)
    kv_rows.gather_rows_reference(caches, slots, want)
    torch.cuda.synchronize()
    assert all(o.device.type == "cpu" and torch.equal(o, w.cpu()) for o, w in zip(outs, want))
