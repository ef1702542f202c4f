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
