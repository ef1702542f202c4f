"""The one-token MoE decode front as one CUDA cluster (kernels/moe/decode_front_cuda.py) on the GPU: against the
twin and bit for bit against the Triton front on coarse-grid inputs (exact sums: any summation order routes
alike), the token's FP8 row bitwise the Triton front's on gaussian inputs, the layer through it against cuBLAS
router + route, and CUDA graphs with and without PDL equal to eager calls."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

from kernels.moe import decode_front_cuda as cuda_front  # noqa: E402
from kernels.moe import decode_front_triton as triton_front  # noqa: E402
from kernels.moe.fp8_quant import padded  # noqa: E402
from kernels.moe.reference import route  # noqa: E402
from tests.kernels.test_moe_gpu import (D, DEV, E20, K, assert_front_matches_twin,  # noqa: E402,F401
                                        calc_diff, exact_router_inputs, experts20)


def both_fronts(x, w, b, first, num_local):
    got = cuda_front.decode_front(x, w, b, K, first, num_local, padded(D))
    want = triton_front.decode_front(x, w, b, K, first, num_local, padded(D), triton_front.new_ticket(DEV))
    return got, want


@pytest.mark.parametrize("e,first,num_local", [(32, 0, 32), (128, 0, 128), (128, 32, 32), (128, 96, 32)])
def test_cuda_front_matches_twin_and_triton_front(e, first, num_local):
    for _ in range(3):  # fresh inputs (each call overwrites every output it owns)
        x, w, b = exact_router_inputs(1, e)
        (ids, weights, plan, a), (t_ids, t_weights, t_plan, t_a) = both_fronts(x, w, b, first, num_local)
        used = assert_front_matches_twin(x, w, b, first, num_local, ids, weights, plan, a)
        # and the Triton front's outputs, bit for bit (the weights: the same instructions, the sum's order aside)
        assert torch.equal(ids, t_ids) and torch.equal(plan.counts, t_plan.counts)
        assert torch.equal(plan.row_of_pair, t_plan.row_of_pair) and int(plan.num_active) == int(t_plan.num_active)
        n = int(plan.num_active)
        assert torch.equal(plan.active[:n], t_plan.active[:n])
        assert torch.equal(plan.token_of_row[used], t_plan.token_of_row[used])
        # two fp32 ulps: the sum of the four exps in the other front's order (seen: 2.19e-7 relative, 2026-12-04)
        torch.testing.assert_close(weights, t_weights, rtol=2.4e-7, atol=0)
        assert torch.equal(a.data.view(torch.uint8), t_a.data.view(torch.uint8))
        assert torch.equal(a.scales_rows(), t_a.scales_rows())


def test_cuda_front_quantizes_gaussian_tokens_as_the_triton_front():
    x = torch.randn(1, D, device=DEV, dtype=torch.bfloat16) * 3
    w = torch.randn(128, D, device=DEV, dtype=torch.bfloat16) * D ** -0.5
    b = torch.randn(128, device=DEV, dtype=torch.bfloat16) * 0.1
    (_, _, _, a), (_, _, _, t_a) = both_fronts(x, w, b, 0, 128)
    assert torch.equal(a.data.view(torch.uint8), t_a.data.view(torch.uint8))
    assert torch.equal(a.scales_rows(), t_a.scales_rows())


def test_routed_forward_through_the_cuda_front(experts20, monkeypatch):
    """The layer with the CUDA front against cuBLAS router + route + the same layer (gaussian inputs: a logit may
    round one bf16 step apart, as for the Triton front)."""
    fp8, _ = experts20
    monkeypatch.setattr(fp8, "cuda_front", True)
    w = torch.randn(E20, D, device=DEV, dtype=torch.bfloat16) * D ** -0.5
    b = torch.randn(E20, device=DEV, dtype=torch.bfloat16) * 0.1
    for _ in range(3):
        x = torch.randn(1, D, device=DEV, dtype=torch.bfloat16)
        got = fp8.routed_forward(x, w, b, K)
        assert calc_diff(got, fp8(x, *route(torch.nn.functional.linear(x, w, b), K))) < 1e-6


def test_cuda_front_in_graphs_with_and_without_pdl(experts20, monkeypatch):
    """routed_forward at one token captured with PDL and without: replays on fresh inputs equal the eager call
    and each other, bit for bit (a launch reading its input early would see the last replay's token)."""
    from kernels import pdl

    fp8, _ = experts20
    monkeypatch.setattr(fp8, "cuda_front", True)
    w = torch.randn(E20, D, device=DEV, dtype=torch.bfloat16) * D ** -0.5
    b = torch.randn(E20, device=DEV, dtype=torch.bfloat16) * 0.1
    src = torch.randn(1, D, device=DEV, dtype=torch.bfloat16)
    norm_w = torch.rand(D, device=DEV) + 0.5

    def chain():  # the front reads what a Triton kernel (the norm, a PDL launch) wrote just before it
        from kernels import layers

        return fp8.routed_forward(layers.rms_norm(src, norm_w, 1e-5), w, b, K)

    graphs, outs = {}, {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)
        chain()
        graphs[on] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[on]):
            outs[on] = chain()
    monkeypatch.setattr(pdl, "ENABLED", True)
    for _ in range(4):
        src.copy_(torch.randn_like(src))
        eager = chain()
        for on in (False, True):
            graphs[on].replay()
            torch.cuda.synchronize()
            assert torch.equal(outs[on], eager), f"PDL {on}"


def test_auto_takes_the_cuda_front_for_128_experts_only():
    """EngineConfig.decode_front through build_model on the GPU: auto builds the extension while the weights are
    drawn and flags every layer for routers of 128 experts, not 32; 'cuda' flags them at 32 too."""
    from engine.model_factory import build_model
    from kernels.moe.fp8_experts import Fp8Experts
    from model.config import GptOssConfig

    def flagged(experts: int, choice: str) -> list[bool]:
        config = GptOssConfig(num_hidden_layers=2, num_local_experts=experts, vocab_size=512, hidden_size=256,
                              intermediate_size=256, num_attention_heads=16, num_key_value_heads=2)
        model = build_model(config, "cuda", torch.bfloat16, random_weights=True, max_batch=4, max_kv_len=256,
                            decode_front=choice)
        return [m.cuda_front for m in model.modules() if isinstance(m, Fp8Experts)]

    assert flagged(128, "auto") == [True, True]
    assert flagged(32, "auto") == [False, False]
    assert flagged(32, "cuda") == [True, True]
    assert flagged(128, "triton") == [False, False]
