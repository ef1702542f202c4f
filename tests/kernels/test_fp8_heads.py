"""Per-head FP8 quantization of attention rows (kernels/attention/fp8_heads_triton.py): the twin on CPU, the kernel
under Triton's interpreter (subprocess) and on the GPU against the twin."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import reference
from tests.kernels.interpreter import run_cases


def test_twin_round_trips_within_e4m3_rounding():
    x = torch.randn(300, 8, 64) * torch.linspace(0.01, 30, 8)[None, :, None]
    q, scale = reference.quantize_heads_fp8(x)
    back = q.float() * scale[None, :, None]
    # e4m3 keeps 3 mantissa bits: a relative step of at most 2^-4 for normals, an absolute 2^-9 * scale below
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + scale[None, :, None] * 2 ** -9).all()
    assert torch.allclose(scale, x.abs().amax((0, 2)) / 448)


def test_kernel_under_the_interpreter():
    """tests/kernels/fp8_heads_interpreter_cases.py: the Triton kernel against the twin."""
    run_cases("fp8_heads_interpreter_cases.py")


def test_bad_rows_are_refused():
    pytest.importorskip("triton")
    from kernels.attention.fp8_heads_triton import quantize_heads_fp8

    with pytest.raises(ValueError, match="contiguous last dimension"):
        quantize_heads_fp8(torch.randn(4, 64, 2).transpose(1, 2))
    with pytest.raises(ValueError, match="power of two"):
        quantize_heads_fp8(torch.randn(4, 2, 48))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("tokens", [1, 129, 4099])
def test_kernel_on_the_gpu(tokens):
    from kernels.attention.fp8_heads_triton import quantize_heads_fp8

    wide = torch.randn(tokens, 80, 64, device="cuda") * torch.rand(1, 80, 1, device="cuda") * 10
    x = wide[:, 64:72].bfloat16()
    got, scale = quantize_heads_fp8(x)
    want, want_scale = reference.quantize_heads_fp8(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
