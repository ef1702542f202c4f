"""The weight-streaming grouped GEMM over contiguous segments (triton_grouped_gemm.grouped_gemm_segments) on the GPU:
against its torch twin on real plans and gpt-oss expert shapes, and the MoE layer running it against the bf16
reference, against the layer on DeepGEMM / the general Triton GEMM, and replayed in a CUDA graph with PDL."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

from kernels.moe import fp8_reference as ref  # noqa: E402
from kernels.moe.fp8_quant import padded, quantize_weight_blocks  # noqa: E402
from kernels.moe.reference import route  # noqa: E402
from tests.kernels.test_moe_gpu import (D, DEV, E20, I, K, assert_graph_replays_match_eager, backends,  # noqa: E402
                                        calc_diff, make_experts20)


@pytest.fixture(scope="module")
def experts20():
    return make_experts20()


@pytest.mark.parametrize("t,e,block_t", [(65, 32, 16), (300, 32, 64), (300, 32, 16), (700, 32, 128), (512, 128, 32),
                                         (2048, 128, 64)])
@pytest.mark.parametrize("n,block_n", [(2 * I, 64), (D, 32), (D, 128)])
def test_segments_gemm_matches_twin(t, e, block_t, n, block_n):
    from kernels.moe.epilogues_triton import Fp8Rows, dispatch_quant
    from kernels.moe.routing_triton import plan_contiguous
    from kernels.moe.triton_grouped_gemm import grouped_gemm_segments

    w, ws = quantize_weight_blocks(torch.randn(e, n, D, device=DEV) * D ** -0.5)
    ids = route(torch.randn(t, e, device=DEV), K)[0]
    plan = plan_contiguous(ids, 0, e, 128)
    a = Fp8Rows.empty(1, plan.num_rows, padded(D), DEV)
    a.data.view(torch.uint8).fill_(0x7F)  # NaN codes in the padding rows: read, they would show
    dispatch_quant(torch.randn(t, D, device=DEV, dtype=torch.bfloat16), plan.row_of_pair, K, a)
    out = torch.full((plan.num_rows, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    grouped_gemm_segments(a, w, ws, out, plan.counts, plan.psum, block_t, config={"BLOCK_N": block_n}, k_valid=D)
    valid = plan.m_indices >= 0
    want = ref.grouped_gemm(a.data, a.scales_rows(), w, ws, plan.m_indices)
    assert torch.isfinite(out[valid]).all() and out[~valid].isnan().all()
    assert calc_diff(out[valid], want[valid]) < 1e-5


@pytest.mark.parametrize("t", [65, 129, 700])
@pytest.mark.parametrize("backend", ["triton", "deep_gemm"])
def test_layer_on_segments_matches_the_reference(experts20, backend, t):
    if backend not in backends():
        pytest.skip("deep_gemm unavailable")
    fp8, bf16_ref = experts20
    fp8.backend, fp8.masked_max_tokens = backend, 64
    x = torch.randn(t, D, device=DEV, dtype=torch.bfloat16)
    ids, weights = route(torch.randn(t, E20, device=DEV, dtype=torch.bfloat16), K)
    default = fp8.segments_max_rows
    try:
        fp8.segments_max_rows = 0
        other = fp8(x, ids, weights)
        fp8.segments_max_rows = 10 ** 6
        out = fp8(x, ids, weights)
    finally:
        fp8.segments_max_rows = default
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert calc_diff(out, bf16_ref(x, ids, weights)) <= 1e-3
    # The other GEMM sums in another order (DeepGEMM: its own promotion of the FP8 products), so a few FP8
    # re-quantized activations land one code apart, as between the layer and its twin (test_moe_gpu.py)
    assert calc_diff(out, other) < 5e-4
    twin = ref.fp8_moe_forward(x, ids, weights, fp8.w13, fp8.s13, fp8.b13, fp8.w2, fp8.s2, fp8.b2, 0, 1.702, 7.0)
    assert calc_diff(out, twin) < 5e-4


def test_segments_in_a_cuda_graph_with_pdl(experts20):
    """A decode step of 128 sequences as the engine's graphs run it (contiguous plan, segments, PDL on): replays on
    fresh routings equal eager forwards."""
    fp8, _ = experts20
    default = fp8.segments_max_rows
    fp8.backend, fp8.masked_max_tokens, fp8.segments_max_rows = backends()[-1], 64, 10 ** 6
    try:
        assert_graph_replays_match_eager(fp8, 128)
    finally:
        fp8.segments_max_rows = default
