"""kernels/attention/fp8_heads_triton.py's per-head FP8 quantization against its torch twin, on CPU tensors under
Triton's interpreter. Run by tests/kernels/test_fp8_heads.py in a subprocess (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_fp8_heads.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

from tests.kernels.interpreter import fresh_seed  # noqa: E402,F401  (autouse fixture)
from kernels.attention.fp8_heads_triton import quantize_heads_fp8  # noqa: E402
from kernels.attention import reference  # noqa: E402


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("tokens,heads", [(1, 3), (77, 8), (130, 5)])
def test_kernel_matches_the_twin(tokens, heads, strided):
    """Strided: the heads are a slice of wider rows (k / v as views of the rotary kernel's qkv rows)."""
    wide = torch.randn(tokens, heads * 3, 64) * torch.rand(1, heads * 3, 1) * 10
    x = (wide[:, heads:2 * heads] if strided else wide[:, :heads].contiguous()).bfloat16()
    x[0, 0, 0] = 0.0
    got, scale = quantize_heads_fp8(x)
    want, want_scale = reference.quantize_heads_fp8(x)
    assert got.shape == x.shape and got.is_contiguous() and got.dtype == torch.float8_e4m3fn
    assert torch.equal(scale, want_scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert (got.float().abs().amax((0, 2)) == 448.0).all()  # each head's largest value maps to e4m3's largest


def test_zero_head_stays_zero_and_finite():
    x = torch.randn(20, 4, 64).bfloat16()
    x[:, 2] = 0
    got, scale = quantize_heads_fp8(x)
    assert torch.isfinite(scale).all() and scale[2] > 0 and not got[:, 2].float().any()
