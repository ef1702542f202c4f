"""kernels/attention/dense_prefill.py on the CPU: a sink-free causal kernel's output and log-sum-exp, rescaled by
sigmoid(lse - sink), equal sink attention (the fp32 reference)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.attention.dense_prefill import causal_attention_lse, dense_sink_prefill, sink_rescale
from kernels.attention.reference import sink_attention


@pytest.mark.parametrize("n,hq,hkv,d", [(1, 8, 1, 16), (37, 8, 2, 16), (129, 4, 4, 32), (300, 16, 2, 64)])
def test_rescaled_causal_attention_equals_sink_attention(n, hq, hkv, d):
    g = torch.Generator().manual_seed(n * 1000 + hq)
    q = torch.randn(n, hq, d, generator=g)
    kv = torch.randn(n, hkv * d * 3, generator=g)  # k / v as strided views of wider rows, as the QKV rows are
    k, v = kv[:, :hkv * d].view(n, hkv, d), kv[:, hkv * d * 2:].view(n, hkv, d)
    sinks = torch.randn(hq, generator=g) * 3
    scale = 1 / math.sqrt(d)
    ref = sink_attention(q, k, v, sinks, scale, None)
    out = dense_sink_prefill(q, k, v, sinks, scale, "cpu")
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    # the sink matters on these inputs: without the rescale the result is another one
    plain, lse = causal_attention_lse(q, k, v, scale, "cpu")
    assert (plain - ref).abs().max() > 1e-2
    assert lse.shape == (hq, n)
    dest = torch.empty(n, hq, d)
    assert sink_rescale(plain, lse, sinks, dest) is dest
    torch.testing.assert_close(dest, ref, atol=2e-6, rtol=1e-5)


def test_unknown_backend_is_refused():
    q = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="backend"):
        causal_attention_lse(q, q, q, 1.0, "xformers")
