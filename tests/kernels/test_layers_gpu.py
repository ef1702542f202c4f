"""kernels/layers on the GPU: add + RMSNorm and rotary (Triton) against their torch twins at gpt-oss
shapes (D 2880, 64 / 8 heads of 64) and awkward token counts, fresh random inputs."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

from kernels.layers import reference as ref  # noqa: E402
from tests.kernels.test_moe_gpu import fp8_codes_close  # noqa: E402

DEV = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 17, 4099])
def test_add_rms_norm(t, dtype):
    from kernels.layers import triton_ops

    x = (torch.randn(t, 2880, device=DEV) * 4).to(dtype)
    delta = torch.randn(t, 2880, device=DEV).to(dtype)
    w = torch.rand(2880, device=DEV) + 0.5
    torch.testing.assert_close(triton_ops.add_rms_norm(x, None, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    s, h = triton_ops.add_rms_norm(x, delta, w, 1e-5)
    want_s, want_h = ref.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(s, want_s)
    torch.testing.assert_close(h, want_h)


@pytest.mark.parametrize("t,hq,hkv", [(1, 64, 8), (13, 16, 2), (2049, 64, 8)])
def test_rotary_qkv_bf16_is_bitwise_the_twin(t, hq, hkv):
    from kernels.layers import triton_ops

    qkv = torch.randn(t, (hq + 2 * hkv) * 64, device=DEV, dtype=torch.bfloat16)
    angles = torch.arange(t, device=DEV, dtype=torch.float32)[:, None] * torch.rand(32, device=DEV)
    cos, sin = angles.cos() * 1.35, angles.sin() * 1.35
    for got, want in zip(triton_ops.rotary_qkv(qkv, cos, sin, hq, hkv, 64), ref.rotary_qkv(qkv, cos, sin, hq, hkv, 64)):
        differ = got != want
        if differ.any():  # say how, before failing: which values, how far apart (in bf16 steps)
            steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
            idx = differ.nonzero()[:3].tolist()
            print(f"{int(differ.sum())} of {got.numel()} differ, max {int(steps.max())} bf16 steps; e.g. at {idx}: "
                  f"got {[got[tuple(i)].item() for i in idx]} want {[want[tuple(i)].item() for i in idx]}")
        assert torch.equal(got, want)


def test_rotary_qkv_fp32_within_an_ulp():
    """fp32: the GPU may fuse a product into the sum (FMA), torch rounds each op: one ulp apart at most."""
    from kernels.layers import triton_ops

    qkv = torch.randn(5, (8 + 2 * 2) * 64, device=DEV)
    angles = torch.rand(5, 32, device=DEV) * 100
    for got, want in zip(triton_ops.rotary_qkv(qkv, angles.cos(), angles.sin(), 8, 2, 64),
                         ref.rotary_qkv(qkv, angles.cos(), angles.sin(), 8, 2, 64)):
        torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-6)


@pytest.mark.parametrize("t", [1, 300])
def test_rotary_qkv_writes_the_paged_cache_bitwise(t):
    """The launch that also writes k/v into the paged cache (the attention backend's kv_destination)."""
    from kernels.layers import triton_ops

    hq, hkv, page, pages = 64, 8, 16, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * 64, device=DEV, dtype=torch.bfloat16)
    angles = torch.arange(t, device=DEV, dtype=torch.float32)[:, None] * torch.rand(32, device=DEV)
    cos, sin = angles.cos(), angles.sin()
    caches = [torch.zeros(pages, page, hkv, 64, device=DEV, dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.randperm(pages * page, device=DEV)[:t + 5]
    slots[::7] = -1
    got = triton_ops.rotary_qkv(qkv, cos, sin, hq, hkv, 64, (caches[0], caches[1], slots))
    want = ref.rotary_qkv(qkv, cos, sin, hq, hkv, 64)
    ref.write_kv(want[1], want[2], caches[2], caches[3], slots)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(5120, 2880), (2880, 4096)])  # gpt-oss QKV and O
def test_gemv_matches_linear(t, n, k):
    from kernels.layers import gemv_triton

    x = torch.randn(t, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    tickets = gemv_triton.new_tickets(n, DEV)
    for bias in (b, None):
        got = gemv_triton.gemv(x, w, bias, tickets)
        want = torch.nn.functional.linear(x, w, bias)  # cuBLAS: fp32 sums in its own order
        assert int(tickets.abs().sum()) == 0
        # one bf16 rounding of fp32 sums taken in different orders: within a bf16 step of the value, or
        # a few steps for values near zero (where a step is tiny against the sums' fp32 error)
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3 * want.float().abs().mean().item())
        assert (got != want).float().mean() < 0.05


def test_gemv_in_cuda_graph_replays_bitwise():
    from kernels.layers import gemv_triton

    x = torch.randn(2, 2880, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(5120, 2880, device=DEV, dtype=torch.bfloat16) * 0.02
    b = torch.randn(5120, device=DEV, dtype=torch.bfloat16)
    tickets = gemv_triton.new_tickets(5120, DEV)
    gemv_triton.gemv(x, w, b, tickets)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv_triton.gemv(x, w, b, tickets)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(y, gemv_triton.gemv(x, w, b, tickets))  # fixed summation order: deterministic


def cosine_distance(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().flatten(), y.double().flatten()
    return float(1 - 2 * (x @ y) / (x @ x + y @ y))


# gpt-oss QKV, O and unembedding; T from one token to past the GEMV's 16-row tile and its 64-token limit
@pytest.mark.parametrize("n,k", [(5120, 2880), (2880, 4096), (201088, 2880)])
@pytest.mark.parametrize("t", [1, 5, 16, 17, 64, 65, 301])
def test_fp8_linear_matches_twin_and_bf16(t, n, k):
    """Fp8Linear on the GPU (the weight-only FP8 GEMV at T <= 64, exact bf16 dequantization + cuBLAS
    above) against the twin (the same rounded weights, fp32 matmul), and the bf16 projection within the
    weights' FP8 rounding."""
    from kernels.layers import fp8_linear

    lin = torch.nn.Linear(k, n, bias=n != 201088, device=DEV, dtype=torch.bfloat16).requires_grad_(False)
    torch.nn.init.normal_(lin.weight, 0, k ** -0.5)
    if lin.bias is not None:
        torch.nn.init.normal_(lin.bias, 0, 0.1)
    f = fp8_linear.Fp8Linear.from_linear(lin)
    x = (torch.randn(t, k, device=DEV) * (torch.rand(k, device=DEV) * 3)).bfloat16()
    got = f(x)
    want = fp8_linear.reference(x, f.weight, f.weight_scale, f.bias)
    assert got.shape == (t, n) and got.dtype == torch.bfloat16
    # the same products, fp32 sums in another order, one rounding: within a bf16 step (or a step of the
    # typical value where the sum cancels)
    err = (got.float() - want.float()).abs()
    assert bool((err <= want.float().abs() * 2 ** -7 + want.float().abs().mean() * 2 ** -8).all()), err.max().item()
    assert cosine_distance(got, lin(x)) < 1e-3  # the weights' FP8 rounding (~2^-5 relative)
    assert int(f.gemv_tickets.abs().sum()) == 0


def test_fp8_gemv_in_cuda_graph_replays_bitwise():
    from kernels.layers import fp8_linear

    lin = torch.nn.Linear(2880, 5120, device=DEV, dtype=torch.bfloat16).requires_grad_(False)
    f = fp8_linear.Fp8Linear.from_linear(lin)
    x = torch.randn(3, 2880, device=DEV, dtype=torch.bfloat16)
    f(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = f(x)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(y, f(x))  # fixed summation order: deterministic, also with PDL in the graph


@pytest.mark.parametrize("t,d", [(1, 2880), (65, 2880), (4099, 2880), (7, 300)])
def test_norm_quantized_for_an_fp8_gemm(t, d):
    """The norm's FP8 output (dense_dtype="fp8_e4m3"): fp8_quant.quantize_rows of the same kernel's bf16 norm (codes
    equal but for a few one step apart, as the MoE's quantizers on the GPU: test_moe_gpu.fp8_codes_close; zero K
    padding; scales to 1e-6), and the residual with O's bias folded in exactly the twin's."""
    from kernels.layers import triton_ops
    from kernels.moe.epilogues_triton import Fp8Rows
    from kernels.moe.fp8_quant import padded, quantize_rows

    x = (torch.randn(t, d, device=DEV) * (torch.rand(d, device=DEV) * 4)).bfloat16()
    delta, bias = torch.randn(t, d, device=DEV).bfloat16(), torch.randn(d, device=DEV).bfloat16()
    w = torch.rand(d, device=DEV) + 0.5
    kp = padded(d)
    rows = Fp8Rows.empty(1, t, kp, DEV)
    s, got = triton_ops.add_rms_norm(x, delta, w, 1e-5, delta_bias=bias, quant_out=rows)
    want_s, _ = ref.add_rms_norm(x, delta, w, 1e-5, delta_bias=bias)
    assert got is rows and torch.equal(s, want_s)
    h = triton_ops.add_rms_norm(x, delta, w, 1e-5, delta_bias=bias)[1]
    q, sc = quantize_rows(h.float(), kp)
    fp8_codes_close(rows.data, q)
    assert not rows.data[:, d:].view(torch.uint8).any()
    torch.testing.assert_close(rows.scales_rows(), sc, rtol=1e-6, atol=0)


@pytest.mark.parametrize("t", [1, 130, 2049])
def test_rotary_qkv_with_bias_is_bitwise_the_twin(t):
    from kernels.layers import triton_ops

    hq, hkv = 64, 8
    qkv = torch.randn(t, (hq + 2 * hkv) * 64, device=DEV, dtype=torch.bfloat16)
    bias = torch.randn((hq + 2 * hkv) * 64, device=DEV, dtype=torch.bfloat16)
    angles = torch.arange(t, device=DEV, dtype=torch.float32)[:, None] * torch.rand(32, device=DEV)
    cos, sin = angles.cos() * 1.35, angles.sin() * 1.35
    want = ref.rotary_qkv(ref.add_bias(qkv, bias), cos, sin, hq, hkv, 64)
    for got, w in zip(triton_ops.rotary_qkv(qkv, cos, sin, hq, hkv, 64, bias=bias), want):
        assert torch.equal(got, w)


@pytest.mark.parametrize("backend", ["deep_gemm", "triton"])
@pytest.mark.parametrize("n,k", [(5120, 2880), (2880, 4096), (200, 300)])  # gpt-oss QKV and O, awkward blocks
@pytest.mark.parametrize("t", [65, 129, 4096])
def test_fp8_linear_with_fp8_activations_matches_twin(t, n, k, backend, monkeypatch):
    """dense_dtype="fp8_e4m3" above 64 tokens: the quantized rows (Triton) times the FP8 weights on DeepGEMM or
    the Triton grouped GEMM, against the twin (reference_w8a8 on the same rows, fp32 products), and the bf16
    projection within the FP8 rounding of both operands; in a CUDA graph the same bits."""
    from kernels.layers import fp8_linear, quantize_rows
    from kernels.moe import deep_gemm_ops
    from kernels.moe.fp8_quant import quantize_rows as twin_rows

    if backend == "deep_gemm" and not deep_gemm_ops.available():
        pytest.skip(f"DeepGEMM: {deep_gemm_ops.why_unavailable()}")
    if backend == "triton":
        monkeypatch.setattr(deep_gemm_ops, "available", lambda: False)
    lin = torch.nn.Linear(k, n, bias=True, device=DEV, dtype=torch.bfloat16).requires_grad_(False)
    torch.nn.init.normal_(lin.weight, 0, k ** -0.5)
    torch.nn.init.normal_(lin.bias, 0, 0.1)
    f = fp8_linear.Fp8Linear.from_linear(lin, fp8_activations=True)
    x = (torch.randn(t, k, device=DEV) * (torch.rand(k, device=DEV) * 3)).bfloat16()
    rows = quantize_rows(x, f.k_padded)
    q, s = twin_rows(x.float(), f.k_padded)
    fp8_codes_close(rows.data, q)
    torch.testing.assert_close(rows.scales_rows(), s, rtol=1e-6, atol=0)
    got = f.gemm(rows)
    want = fp8_linear.reference_w8a8(rows.data, rows.scales_rows(), f.weight, f.weight_scale, k, torch.bfloat16).float()
    err = (got.float() - want).abs()
    assert bool((err <= want.abs() * 2 ** -6 + want.abs().mean() * 2 ** -7).all()), err.max().item()
    assert cosine_distance(got, want) < 1e-5
    full = f(x)
    assert torch.equal(full, ref.add_bias(got, f.bias))
    assert cosine_distance(full, lin(x)) < 2e-3  # e4m3 rounding of x and W (~2^-5 relative each)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = f(x)
    graph.replay()
    assert torch.equal(y, full)


# gpt-oss QKV and O, plus awkward N / K (partial scale blocks, K below its padding, several splits)
@pytest.mark.parametrize("n,k", [(5120, 2880), (2880, 4096), (1100, 700)])
@pytest.mark.parametrize("t", [1, 2, 3, 4])
@pytest.mark.parametrize("cfg", [dict(BLOCK_N=16, K_SPLIT=512), dict(BLOCK_N=32, K_SPLIT=1024, num_warps=8,
                                                                      weights_first=True)])
def test_slab_gemv_matches_twins(t, n, k, cfg):
    """The slab GEMV on FP8 weights against fp8_linear.reference and on bf16 weights against F.linear in
    fp32 (the same products, fp32 sums in another order: within a bf16 step)."""
    from kernels.layers import fp8_linear, slab_gemv_triton

    x = (torch.randn(t, k, device=DEV) * (torch.rand(k, device=DEV) * 3)).bfloat16()
    w32 = torch.randn(n, k, device=DEV) * k ** -0.5
    w, sw = fp8_linear.quantize_weight(w32)
    b = torch.randn(n, device=DEV).bfloat16()
    tickets = fp8_linear.gemv_tickets(n, DEV)
    for weight, scale, want in [(w, sw, fp8_linear.reference(x, w, sw, b).float()),
                                (w32.bfloat16(), None, x.float() @ w32.bfloat16().float().T + b.float())]:
        got = slab_gemv_triton.slab_gemv(x, weight, scale, b, tickets, cfg)
        assert got.shape == (t, n) and got.dtype == torch.bfloat16
        err = (got.float() - want).abs()
        assert bool((err <= want.abs() * 2 ** -7 + want.abs().mean() * 2 ** -8).all()), err.max().item()
        assert int(tickets.abs().sum()) == 0


@pytest.mark.parametrize("weights_first", [False, True])
def test_slab_gemv_in_cuda_graph_replays_bitwise(weights_first):
    """Captured with PDL after a producer kernel that writes x (the weights loaded before the PDL wait with
    weights_first): every replay equals the eager call on the same fresh inputs."""
    from kernels.layers import fp8_linear, slab_gemv_triton, triton_ops

    w, sw = fp8_linear.quantize_weight(torch.randn(5120, 2880, device=DEV) * 0.02)
    tickets = fp8_linear.gemv_tickets(5120, DEV)
    src, norm_w = torch.randn(1, 2880, device=DEV).bfloat16(), torch.rand(2880, device=DEV) + 0.5
    cfg = dict(BLOCK_N=16, K_SPLIT=1024, weights_first=weights_first)

    def step():
        return slab_gemv_triton.slab_gemv(triton_ops.add_rms_norm(src, None, norm_w, 1e-5), w, sw, None, tickets, cfg)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    for _ in range(3):
        src.copy_(torch.randn_like(src))
        graph.replay()
        assert torch.equal(y, step())
