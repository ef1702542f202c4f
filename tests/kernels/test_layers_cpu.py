"""kernels/layers on CPU: the dispatchers run the twins, the model-facing contract holds, and (in a
subprocess, under Triton's interpreter) the Triton kernels match the twins."""

from __future__ import annotations

import pytest
import torch

from kernels import layers
from kernels.layers import reference as ref
from tests.kernels.interpreter import run_cases


def test_cpu_dispatch_is_the_twin():
    x, delta, w = torch.randn(4, 48), torch.randn(4, 48), torch.rand(48)
    assert torch.equal(layers.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    s, h = layers.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(s, x + delta) and torch.equal(h, ref.rms_norm(x + delta, w, 1e-5))
    qkv, cos, sin = torch.randn(4, (4 + 2 * 2) * 8), torch.randn(4, 4), torch.randn(4, 4)
    for a, b in zip(layers.rotary_qkv(qkv, cos, sin, 4, 2, 8), ref.rotary_qkv(qkv, cos, sin, 4, 2, 8)):
        assert torch.equal(a, b)


def test_rotary_rotates_q_and_k_and_passes_v_through():
    t, hq, hkv, dh = 3, 4, 2, 8
    qkv = torch.randn(t, (hq + 2 * hkv) * dh)
    zero = torch.zeros(t, dh // 2)
    q, k, v = layers.rotary_qkv(qkv, zero + 1, zero, hq, hkv, dh)  # angle 0: identity
    assert torch.equal(torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1), qkv)
    q, _, _ = layers.rotary_qkv(qkv, zero, zero + 1, hq, hkv, dh)  # angle 90 degrees: (x1, x2) -> (-x2, x1)
    x1, x2 = qkv[:, :hq * dh].reshape(t, hq, dh).chunk(2, -1)
    assert torch.equal(q, torch.cat([-x2, x1], -1))


def test_triton_kernels_under_interpreter():
    """tests/kernels/layers_interpreter_cases.py: add + RMSNorm and rotary against the twins."""
    pytest.importorskip("triton")
    run_cases("layers_interpreter_cases.py")


def cosine_distance(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().flatten(), y.double().flatten()
    return float(1 - 2 * (x @ y) / (x @ x + y @ y))


@pytest.mark.parametrize("n,k", [(200, 300), (129, 128), (64, 2880)])
def test_fp8_weight_quantization_round_trip(n, k):
    """128x128 blocks with power-of-two scales: every weight within half an e4m3 step, none saturated, K
    padding zero, and the dequantized values exact in bf16."""
    from kernels.layers import fp8_linear

    w = torch.randn(n, k) * torch.rand(n, 1) * 3  # rows of different magnitudes share a block
    q, s = fp8_linear.quantize_weight(w)
    assert q.shape == (n, -(-k // 128) * 128) and s.shape == (-(-n // 128), q.shape[1] // 128)
    assert not q[:, k:].float().any()
    back = fp8_linear.dequantize_weight_blocks(q[None], s[None], k)[0]
    scale = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    # e4m3 keeps 3 mantissa bits (relative error <= 2^-4); below 2^-6 it is subnormal, spaced 2^-9 x scale
    assert bool(((back - w).abs() <= torch.maximum(w.abs() * 2 ** -4, scale * 2 ** -10) * (1 + 1e-6)).all())
    # the smallest power of two putting the block's largest magnitude at or below 448: nothing saturates
    amax = torch.nn.functional.pad(w.abs(), (0, q.shape[1] - k, 0, s.shape[0] * 128 - n)) \
        .view(s.shape[0], 128, s.shape[1], 128).amax(dim=(1, 3)).clamp(min=1e-4)
    assert torch.equal(s, torch.exp2(torch.ceil(torch.log2(amax / 448))))
    assert torch.equal(back.bfloat16().float(), back)
    assert bool(torch.isfinite(s).all()) and bool((s > 0).all())


@pytest.mark.parametrize("t", [1, 5, 33])
def test_fp8_linear_follows_the_bf16_linear(t):
    """Fp8Linear.from_linear on CPU (the twin): close to the bf16 projection (FP8 rounding of both operands),
    exactly the twin's formula, and the row-parallel form without the bias."""
    from kernels.layers import fp8_linear

    lin = torch.nn.Linear(300, 200, bias=True)
    with torch.no_grad():
        lin.bias.normal_(0, 0.1)
    lin = lin.to(torch.bfloat16).requires_grad_(False)
    f = fp8_linear.Fp8Linear.from_linear(lin)
    assert f.weight.dtype == torch.float8_e4m3fn and f.bias.dtype == torch.bfloat16
    x = torch.randn(t, 300).bfloat16()
    got = f(x)
    assert got.dtype == torch.bfloat16 and got.shape == (t, 200)
    assert torch.equal(got, fp8_linear.reference(x, f.weight, f.weight_scale, f.bias))
    exact = lin(x)
    d = cosine_distance(got, exact)
    assert 1e-6 < d < 2e-3, d  # FP8 noise is there, and small (e4m3: ~2^-5 relative per operand)
    no_bias = f(x, with_bias=False)
    torch.testing.assert_close(no_bias.float() + f.bias.float(), got.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("t", [64, 65, 130])
def test_fp8_linear_with_fp8_activations(t):
    """fp8_activations=True (dense_dtype="fp8_e4m3"): up to 64 tokens the weight-only twin; above, x quantized
    per token per 128 channels times the FP8 weights (reference_w8a8), the bias added after the rounding; `gemm` on
    rows quantized elsewhere is the same GEMM without the bias. Close to the bf16 projection either way."""
    from kernels.layers import fp8_linear
    from kernels.moe.fp8_quant import quantize_rows

    lin = torch.nn.Linear(300, 200, bias=True)
    with torch.no_grad():
        lin.bias.normal_(0, 0.1)
    lin = lin.to(torch.bfloat16).requires_grad_(False)
    f = fp8_linear.Fp8Linear.from_linear(lin, fp8_activations=True)
    assert f.k_padded == 384 and f.quantizes(t) == (t > 64)
    x = (torch.randn(t, 300) * torch.rand(1, 300) * 4).bfloat16()
    got = f(x)
    assert got.dtype == torch.bfloat16 and got.shape == (t, 200)
    if t <= 64:
        assert torch.equal(got, fp8_linear.reference(x, f.weight, f.weight_scale, f.bias))
    else:
        q, s = quantize_rows(x.float(), 384)
        unbiased = fp8_linear.reference_w8a8(q, s, f.weight, f.weight_scale, 300, torch.bfloat16)
        assert torch.equal(got, ref.add_bias(unbiased, f.bias))
        assert torch.equal(f.gemm(layers.quantize_rows(x, 384)), unbiased)
        assert not torch.equal(got, fp8_linear.reference(x, f.weight, f.weight_scale, f.bias))  # activations rounded
        assert torch.equal(f(x, with_bias=False), unbiased)
    d = cosine_distance(got, lin(x))
    assert 1e-6 < d < 3e-3, d
