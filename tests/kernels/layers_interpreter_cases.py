"""kernels/layers Triton kernels (add + RMSNorm, rotary) against their torch twins, on CPU tensors under
Triton's interpreter. Run by tests/kernels/test_layers_cpu.py in a subprocess (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_layers_cpu.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

from tests.kernels.interpreter import fresh_seed  # noqa: E402,F401  (autouse fixture)
from kernels.layers import reference as ref  # noqa: E402
from kernels.layers import triton_ops  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(1, 2880), (7, 100), (33, 64)])
def test_rms_norm_and_residual_add(t, d, dtype):
    x = (torch.randn(t, d) * 3).to(dtype)
    delta = torch.randn(t, d).to(dtype)
    w = torch.rand(d) + 0.5
    torch.testing.assert_close(triton_ops.add_rms_norm(x, None, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    s, h = triton_ops.add_rms_norm(x, delta, w, 1e-5)
    want_s, want_h = ref.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(s, want_s)  # the residual add rounds exactly like torch's
    torch.testing.assert_close(h, want_h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(1, 2880), (7, 100)])
def test_residual_add_with_a_projection_bias(t, d, dtype):
    """delta_bias (O's bias when its FP8 GEMM left it out): added to delta first, rounded, exactly as the twin."""
    x, delta = (torch.randn(t, d) * 3).to(dtype), torch.randn(t, d).to(dtype)
    bias, w = torch.randn(d).to(dtype), torch.rand(d) + 0.5
    s, h = triton_ops.add_rms_norm(x, delta, w, 1e-5, delta_bias=bias)
    want_s, want_h = ref.add_rms_norm(x, delta, w, 1e-5, delta_bias=bias)
    assert torch.equal(s, want_s)
    torch.testing.assert_close(h, want_h)
    assert not torch.equal(s, ref.add_rms_norm(x, delta, w, 1e-5)[0])  # the bias is in


@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("t,d", [(1, 2880), (7, 100), (3, 256)])
def test_norm_quantized_for_an_fp8_gemm(t, d, with_delta):
    """quant_out: the normed rows as FP8 per 128 channels (K padded with zeros, scales MN-major), exactly what
    fp8_quant.quantize_rows makes of the same kernel's bf16 norm, and the residual as without it."""
    from kernels.moe.epilogues_triton import Fp8Rows
    from kernels.moe.fp8_quant import padded, quantize_rows

    x = (torch.randn(t, d) * torch.rand(1, d) * 4).bfloat16()  # 128-blocks of different magnitudes
    delta = torch.randn(t, d).bfloat16() if with_delta else None
    w = torch.rand(d) + 0.5
    kp = padded(d)
    rows = Fp8Rows.empty(1, t, kp, "cpu")
    rows.data.fill_(1.0)
    got = triton_ops.add_rms_norm(x, delta, w, 1e-5, quant_out=rows)
    plain = triton_ops.add_rms_norm(x, delta, w, 1e-5)
    if with_delta:
        assert got[1] is rows and torch.equal(got[0], plain[0])
        plain = plain[1]
    else:
        assert got is rows
    q, sc = quantize_rows(plain.float(), kp)
    assert torch.equal(rows.data.view(torch.uint8), q.view(torch.uint8))  # padding columns too: zeros
    assert torch.equal(rows.scales_rows(), sc)


@pytest.mark.parametrize("with_cache,v_out", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("t,hq,hkv,dh", [(1, 4, 1, 16), (5, 6, 3, 8)])
def test_rotary_qkv_adds_the_projection_bias(t, hq, hkv, dh, with_cache, v_out, rotary_block_t):
    """bias (QKV's when its FP8 GEMM left it out): added to every head before the rotary, exactly the twin's
    add_bias + rotary; k / v in the cache carry it, and v (a view of qkv without v_out) does too."""
    dtype = torch.bfloat16
    qkv = torch.randn(t, (hq + 2 * hkv) * dh).to(dtype)
    bias = torch.randn((hq + 2 * hkv) * dh).to(dtype)
    angles = torch.rand(t, dh // 2) * 50
    cos, sin = angles.cos(), angles.sin()
    want = ref.rotary_qkv(ref.add_bias(qkv, bias), cos, sin, hq, hkv, dh)
    k_cache = torch.full((4, 4, hkv, dh), 9.0, dtype=dtype)
    v_cache = torch.full_like(k_cache, 9.0)
    slots = torch.randperm(16)[:t]
    outs = [None] * 3 if not v_out else [torch.empty(t, h, dh, dtype=dtype) for h in (hq, hkv, hkv)]
    got = triton_ops.rotary_qkv(qkv, cos, sin, hq, hkv, dh, (k_cache, v_cache, slots) if with_cache else None,
                                *outs, bias=bias)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    if with_cache:
        want_k, want_v = torch.full_like(k_cache, 9.0), torch.full_like(v_cache, 9.0)
        ref.write_kv(want[1], want[2], want_k, want_v, slots)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.fixture(params=[1, 4], ids=["token per program", "4 tokens per program"])
def rotary_block_t(request, monkeypatch):
    """Both launch shapes of the rotary kernel: one token per program (decode) and the prompt tiling (forced on
    from the first token, so the small cases here end in a partial tile)."""
    monkeypatch.setattr(triton_ops, "ROTARY_BLOCK_T", request.param)
    monkeypatch.setattr(triton_ops, "ROTARY_TILED_FROM", 1)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,hq,hkv,dh", [(1, 8, 2, 16), (5, 64, 8, 64), (3, 3, 1, 8)])
def test_rotary_qkv_matches_twin_exactly(t, hq, hkv, dh, dtype, rotary_block_t):
    qkv = torch.randn(t, (hq + 2 * hkv) * dh).to(dtype)
    angles = torch.rand(t, dh // 2) * 50
    cos, sin = angles.cos() * 1.3, angles.sin() * 1.3
    got = triton_ops.rotary_qkv(qkv, cos, sin, hq, hkv, dh)
    want = ref.rotary_qkv(qkv, cos, sin, hq, hkv, dh)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w)
    table = torch.stack((cos, sin), dim=1)  # cos / sin as row views of one [T, 2, Dh/2] table (RotaryEmbedding's)
    for g, w in zip(triton_ops.rotary_qkv(qkv, table[:, 0], table[:, 1], hq, hkv, dh), want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,hq,hkv,dh,page", [(1, 4, 1, 16, 16), (5, 6, 3, 8, 4)])
def test_rotary_qkv_writes_the_paged_cache(t, hq, hkv, dh, page, dtype, rotary_block_t):
    """The cache-writing variant: same q/k/v, and k (rotated) / v land in their slots, -1 skipped."""
    qkv = torch.randn(t, (hq + 2 * hkv) * dh).to(dtype)
    angles = torch.rand(t, dh // 2) * 50
    cos, sin = angles.cos(), angles.sin()
    pages = 4
    k_cache = torch.full((pages, page, hkv, dh), 9.0, dtype=dtype)
    v_cache = torch.full_like(k_cache, 9.0)
    slots = torch.randperm(pages * page)[: t + 2]  # more slots than tokens, as the padded decode buffers
    slots[t // 2] = -1
    got = triton_ops.rotary_qkv(qkv, cos, sin, hq, hkv, dh, (k_cache, v_cache, slots))
    want = ref.rotary_qkv(qkv, cos, sin, hq, hkv, dh)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    want_k, want_v = torch.full_like(k_cache, 9.0), torch.full_like(v_cache, 9.0)
    ref.write_kv(want[1], want[2], want_k, want_v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert int((k_cache != 9.0).any(-1).any(-1).sum()) == t - 1  # one padding token wrote nothing


@pytest.mark.parametrize("with_cache", [False, True])
@pytest.mark.parametrize("t,hq,hkv,dh", [(1, 4, 1, 16), (5, 6, 3, 8)])
def test_rotary_qkv_into_given_rows(t, hq, hkv, dh, with_cache, rotary_block_t):
    """q_out / k_out / v_out: q, k and v written into the caller's contiguous rows (v copied, not a view of
    qkv), with or without the cache write, bitwise the twin's."""
    dtype = torch.bfloat16
    qkv = torch.randn(t, (hq + 2 * hkv) * dh).to(dtype)
    angles = torch.rand(t, dh // 2) * 50
    cos, sin = angles.cos(), angles.sin()
    outs = [torch.full((t, h, dh), 7.0, dtype=dtype) for h in (hq, hkv, hkv)]
    k_cache = torch.full((4, 4, hkv, dh), 9.0, dtype=dtype)
    v_cache = torch.full_like(k_cache, 9.0)
    slots = torch.randperm(16)[:t]
    got = triton_ops.rotary_qkv(qkv, cos, sin, hq, hkv, dh, (k_cache, v_cache, slots) if with_cache else None, *outs)
    want = ref.rotary_qkv(qkv, cos, sin, hq, hkv, dh)
    for g, out, w in zip(got, outs, want):
        assert g.data_ptr() == out.data_ptr() and torch.equal(out, w)
    if with_cache:
        want_k, want_v = torch.full_like(k_cache, 9.0), torch.full_like(v_cache, 9.0)
        ref.write_kv(want[1], want[2], want_k, want_v, slots)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


# (T, N, K): one token over a QKV-like width, awkward N and K (partial blocks), the largest batch
@pytest.mark.parametrize("t,n,k", [(1, 320, 200), (5, 100, 300), (16, 48, 1000), (3, 1100, 256)])  # last: one K split
@pytest.mark.parametrize("with_bias", [True, False])
def test_gemv_matches_linear(t, n, k, with_bias):
    from kernels.layers import gemv_triton

    x = torch.randn(t, k).bfloat16()
    w = (torch.randn(n, k) * k ** -0.5).bfloat16()
    b = torch.randn(n).bfloat16() if with_bias else None
    tickets = gemv_triton.new_tickets(n, "cpu")
    for cfg in (dict(BLOCK_N=16, BLOCK_K=64, waves=4), dict(BLOCK_N=64, BLOCK_K=128, waves=1)):
        got = gemv_triton.gemv(x, w, b, tickets, cfg)
        assert int(tickets.abs().sum()) == 0  # every block's ticket reset for the next call
        want = x.float() @ w.float().T + (b.float() if with_bias else 0)
        assert got.dtype == torch.bfloat16 and got.shape == (t, n)
        # fp32 sums in another order, one rounding to bf16: within one bf16 step
        torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-5)


# (T, N, K): awkward N (partial 128-blocks of weight scales, partial BLOCK_N), K below its padding
@pytest.mark.parametrize("t,n,k", [(1, 200, 300), (6, 130, 256), (16, 64, 1000), (40, 70, 300), (3, 1100, 256)])  # last: one K split (wide N)
@pytest.mark.parametrize("with_bias", [True, False])
def test_fp8_gemv_matches_twin(t, n, k, with_bias):
    """The FP8 GEMV (weight-only: x in fp16, exact e4m3 weights) against its twin."""
    from kernels.layers import fp8_gemv_triton, fp8_linear

    x = (torch.randn(t, k) * torch.rand(1, k) * 4).bfloat16()  # channel scales differ between 128-blocks
    w, sw = fp8_linear.quantize_weight(torch.randn(n, k) * k ** -0.5)
    b = torch.randn(n).bfloat16() if with_bias else None
    tickets = fp8_linear.gemv_tickets(n, "cpu")
    x[0, 0] = 1e6  # beyond fp16: clamped to 65504 by kernel and twin alike
    want = fp8_linear.reference(x, w, sw, b)
    assert fp8_gemv_triton.GEMV_MAX_TOKENS == fp8_linear.GEMV_MAX_TOKENS
    for cfg in (dict(BLOCK_N=16, waves=4), dict(BLOCK_N=64, waves=1), fp8_gemv_triton.LARGE_N_CONFIG):
        got = fp8_gemv_triton.fp8_gemv(x, w, sw, b, tickets, cfg)
        assert int(tickets.abs().sum()) == 0  # every block's ticket reset for the next call
        assert got.dtype == torch.bfloat16 and got.shape == (t, n)
        # exact products, fp32 sums in another order, scales applied per block: within a bf16 step
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
        assert torch.isfinite(got).all()


# (T, N, K): awkward N (partial 128-blocks of scales, partial BLOCK_N), K below its padding, one split (K <= K_SPLIT)
@pytest.mark.parametrize("t,n,k", [(1, 200, 300), (3, 130, 520), (4, 64, 128), (2, 48, 1000)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_slab_gemv_matches_twins(t, n, k, with_bias):
    """The slab GEMV (fp32 FMAs on CUDA cores) on FP8 weights against fp8_linear.reference and on bf16 weights
    against F.linear in fp32: the same products, fp32 sums in another order, one rounding."""
    from kernels.layers import fp8_linear, slab_gemv_triton

    x = (torch.randn(t, k) * torch.rand(1, k) * 4).bfloat16()
    w32 = torch.randn(n, k) * k ** -0.5
    w, sw = fp8_linear.quantize_weight(w32)
    b = torch.randn(n).bfloat16() if with_bias else None
    tickets = fp8_linear.gemv_tickets(n, "cpu")
    x[0, 0] = 1e6  # beyond fp16: clamped to 65504 on the FP8 path, as by the tensor-core GEMV and the twin
    want8 = fp8_linear.reference(x, w, sw, b).float()
    w16 = w32.bfloat16()
    want16 = (x.float() @ w16.float().T + (b.float() if with_bias else 0))
    for cfg in (dict(BLOCK_N=16, K_SPLIT=128), dict(BLOCK_N=32, K_SPLIT=512, weights_first=True),
                dict(BLOCK_N=64, K_SPLIT=2048)):
        got = slab_gemv_triton.slab_gemv(x, w, sw, b, tickets, cfg)
        assert int(tickets.abs().sum()) == 0  # every block's ticket reset for the next call
        assert got.dtype == torch.bfloat16 and got.shape == (t, n)
        torch.testing.assert_close(got.float(), want8, rtol=2 ** -7, atol=1e-3)
        got = slab_gemv_triton.slab_gemv(x, w16, None, b, tickets, cfg)
        torch.testing.assert_close(got.float(), want16, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("gemv", ["slab", "tensor-core"])
def test_fp8_gemvs_do_not_read_the_k_padding(gemv, monkeypatch):
    """The FP8 weights' columns past x's K (zero padding to 128s) are not read: poisoned with NaN codes they change
    nothing, bit for bit; read (fp8_quant.READ_K_PADDING, the old behaviour) the NaN comes through."""
    from kernels.layers import fp8_gemv_triton, fp8_linear, slab_gemv_triton
    from kernels.moe import fp8_quant

    t, n, k = 2, 130, 300  # Kp 384: 84 padding columns
    x = (torch.randn(t, k) * 4).bfloat16()
    w, sw = fp8_linear.quantize_weight(torch.randn(n, k) * k ** -0.5)
    b = torch.randn(n).bfloat16()
    tickets = fp8_linear.gemv_tickets(n, "cpu")
    poisoned = w.clone()
    poisoned.view(torch.uint8)[:, k:] = 0x7F  # e4m3fn NaN
    run = (lambda w_: slab_gemv_triton.slab_gemv(x, w_, sw, b, tickets)) if gemv == "slab" else \
        (lambda w_: fp8_gemv_triton.fp8_gemv(x, w_, sw, b, tickets))
    clean = run(w)
    assert torch.isfinite(clean).all()
    assert torch.equal(run(poisoned), clean)
    monkeypatch.setattr(fp8_quant, "READ_K_PADDING", True)
    assert torch.equal(run(w), clean)  # reading the zeros gives the same products
    assert run(poisoned).isnan().all()


def test_slab_gemv_rejects_what_it_cannot_run():
    from kernels.layers import fp8_linear, slab_gemv_triton

    w, sw = fp8_linear.quantize_weight(torch.randn(64, 300))
    tickets = fp8_linear.gemv_tickets(64, "cpu")
    for x, cfg in [(torch.randn(5, 300).bfloat16(), {}),  # above slab_gemv_triton.MAX_TOKENS
                   (torch.randn(1, 400).bfloat16(), {}),  # K beyond the weights' padded K
                   (torch.randn(1, 300).bfloat16(), dict(K_SPLIT=384)),  # not a power of two of 128-blocks
                   (torch.randn(1, 300).bfloat16(), dict(BLOCK_N=8))]:  # below the tickets' block
        with pytest.raises(ValueError, match="slab_gemv"):
            slab_gemv_triton.slab_gemv(x, w, sw, None, tickets, cfg)


def test_fp8_dequantize_is_exact():
    """The T > 64 path's bf16 image of an FP8 weight (power-of-two scales): exactly the twin's values."""
    from kernels.layers import fp8_gemv_triton, fp8_linear

    w, sw = fp8_linear.quantize_weight(torch.randn(200, 300) * torch.rand(200, 1) * 3)
    got = fp8_gemv_triton.dequantize(w, sw, 300, torch.bfloat16)
    want = fp8_linear.dequantize_weight_blocks(w[None], sw[None], 300)[0]
    assert got.shape == (200, 300) and torch.equal(got.float(), want)  # bf16 holds every value exactly
