"""The decode GEMV whose weights load before the PDL wait (kernels/layers/gemv_cuda.py, csrc/dense_gemv.cu)
against torch's linear on awkward shapes, and after a PDL producer inside a CUDA graph (GPU only)."""

from __future__ import annotations

import pytest
import torch

from kernels.layers import gemv_cuda


def test_import_builds_nothing_and_cpu_tensors_are_not_taken():
    assert gemv_cuda._extension.cache_info().currsize == 0
    assert not gemv_cuda.runs(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="preload_gemv takes"):
        gemv_cuda.preload_gemv(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16), None)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _want(x, w, b):
    y = x.float() @ w.float().T
    return y + b.float() if b is not None else y


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("n,k,bias", [(5120, 2880, True), (2880, 4096, True), (200, 96, False), (37, 1000, True)])
def test_matches_linear(n, k, bias, t):
    g = torch.Generator(device="cuda").manual_seed(n + k + t)
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16() if bias else None
    for pdl in (False, True):
        got = gemv_cuda.preload_gemv(x, w, b, pdl=pdl)
        want = _want(x, w, b)
        # fp32 sums in another order, one bf16 rounding: within a bf16 step of the exact value
        assert (got.float() - want).abs().max() <= 2 ** -8 * want.abs().max() + 1e-6


@gpu
@pytest.mark.gpu
def test_cuda_graph_after_a_pdl_producer():
    from kernels.layers import triton_ops

    t, k, n = 4, 2880, 5120
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    norm_w = torch.rand(k, device="cuda", generator=g).bfloat16() + 0.5
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16()

    def step():
        x = triton_ops.add_rms_norm(h, None, norm_w, 1e-5)  # launched with PDL while capturing
        return gemv_cuda.preload_gemv(x, w, b)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (2, 3):
        h.copy_(torch.randn(t, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())
