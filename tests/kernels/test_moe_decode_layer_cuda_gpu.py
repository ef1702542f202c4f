"""The one-token MoE layer as one persistent CUDA kernel (kernels/moe/moe_decode_layer_cuda.py) on the GPU: its
routing bit for bit the CUDA front's, its output against the split path it replaces and the bf16 reference on the
same dequantized weights (20b, 120b and awkward shapes, fresh inputs), expert-parallel halves summing to the whole,
a rank with no chosen expert giving zeros, ring depths changing nothing, and CUDA graph replays (with and without
PDL, after a norm kernel) equal to eager calls bit for bit."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

from kernels.moe import decode_front_cuda  # noqa: E402
from kernels.moe import moe_decode_layer_cuda as fused  # noqa: E402
from kernels.moe.fp8_quant import padded  # noqa: E402
from tests.kernels.test_moe_gpu import DEV, E20, K, calc_diff, experts20  # noqa: E402,F401


def make_experts(e: int, d: int, inter: int, seed: int, first: int = 0):
    from kernels.moe.fp8_experts import Fp8Experts

    g = torch.Generator(device=DEV).manual_seed(seed)
    gate_up = torch.randn(e, 2 * inter, d, device=DEV, generator=g, dtype=torch.bfloat16) * d ** -0.5
    down = torch.randn(e, d, inter, device=DEV, generator=g, dtype=torch.bfloat16) * inter ** -0.5
    b13 = torch.randn(e, 2 * inter, device=DEV, generator=g) * 0.1
    b2 = torch.randn(e, d, device=DEV, generator=g) * 0.1
    return Fp8Experts.from_dense(gate_up, b13, down, b2, first, 1.702, 7.0)


def router(e: int, d: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(e, d, device=DEV, generator=g) * d ** -0.5).bfloat16()
    b = (torch.randn(e, device=DEV, generator=g) * 0.1).bfloat16()
    return w, b


def split_path(fp8, x, w, b):
    """What single-token steps run without the kernel: the CUDA front and the four launches after it."""
    saved = fp8.cuda_front, fp8.fused_decode_layer
    fp8.cuda_front, fp8.fused_decode_layer = True, False
    try:
        return fp8.routed_forward(x, w, b, K)
    finally:
        fp8.cuda_front, fp8.fused_decode_layer = saved


def check_layer(fp8, w, b, rounds: int = 3) -> None:
    d = fp8.hidden
    ref = fp8.dequantized(torch.bfloat16)
    barrier = fused.new_barrier(DEV)
    for _ in range(rounds):  # fresh inputs each round
        x = torch.randn(1, d, device=DEV, dtype=torch.bfloat16)
        out, ids, weights = fused.decode_layer(x, w, b, K, fp8, barrier)
        f_ids, f_weights, _, _ = decode_front_cuda.decode_front(x, w, b, K, fp8.first_expert, fp8.num_local,
                                                               padded(d))
        assert torch.equal(ids, f_ids) and torch.equal(weights, f_weights)  # the front's instructions, its order
        assert out.shape == (1, d) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        # the split path sums each 128-deep block's products in another order: bf16 roundings of h and FP8 codes of
        # the activation land a step apart now and then (as kernel vs twin in test_moe_gpu, <= 2.9e-4 measured)
        split = split_path(fp8, x, w, b)
        assert calc_diff(out, split) < 5e-4
        # against the bf16 reference: issue 7's bound, or no further than the split path where the FP8 activations
        # alone exceed it (a 64-wide token is one 128-channel block: seen 1.6e-3 for both paths)
        want = ref(x, ids.long(), weights)
        assert calc_diff(out, want) <= max(1e-3, 1.25 * calc_diff(split, want))
        again, _, _ = fused.decode_layer(x, w, b, K, fp8, barrier)
        assert torch.equal(again, out)  # no atomics feed a value: repeatable bit for bit
    assert barrier[0].item() == 0  # arrivals back at zero after every call


def test_20b_shapes(experts20):
    fp8, _ = experts20
    check_layer(fp8, *router(E20, fp8.hidden, 1))


def test_120b_shapes():
    fp8 = make_experts(128, 2880, 2880, seed=2)
    check_layer(fp8, *router(128, 2880, 3), rounds=2)


@pytest.mark.parametrize("e,d,inter", [(12, 320, 192), (7, 64, 128), (40, 1088, 704)])
def test_awkward_shapes(e, d, inter):
    fp8 = make_experts(e, d, inter, seed=e)
    check_layer(fp8, *router(e, d, e + 1))


def test_ring_depths_and_producers_change_nothing(experts20):
    fp8, _ = experts20
    w, b = router(E20, fp8.hidden, 4)
    deepest = fused._extension().plan_stages(0, fp8.hidden, fp8.intermediate, fp8.w13.shape[2], fp8.w2.shape[2], 0)
    assert deepest >= 3  # 20b's shapes fit more than the minimum ring on an H200
    for _ in range(2):
        x = torch.randn(1, fp8.hidden, device=DEV, dtype=torch.bfloat16)
        outs = [fused.decode_layer(x, w, b, K, fp8, fused.new_barrier(DEV), stages=s, producer=p)[0]
                for s in (2, 3, deepest) for p in ("bulk", "cp_async")]
        assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_expert_parallel_halves_and_a_rank_with_no_expert(experts20):
    from kernels.moe.fp8_experts import Fp8Experts

    fp8, _ = experts20
    d, inter = fp8.hidden, fp8.intermediate
    halves = [Fp8Experts(16, first, d, inter, 1.702, 7.0, DEV) for first in (0, 16)]
    for part, sl in zip(halves, (slice(0, 16), slice(16, 32))):
        part.load_quantized(fp8.w13[sl], fp8.s13[sl], fp8.b13[sl], fp8.w2[sl], fp8.s2[sl], fp8.b2[sl])
    w, b = router(E20, d, 5)
    for _ in range(3):
        x = torch.randn(1, d, device=DEV, dtype=torch.bfloat16)
        whole, ids, _ = fused.decode_layer(x, w, b, K, fp8, fused.new_barrier(DEV))
        parts = [fused.decode_layer(x, w, b, K, p, p.layer_barrier) for p in halves]
        for p_out, p_ids, _ in parts:
            assert torch.equal(p_ids, ids)  # every rank routes over all experts
        assert calc_diff(parts[0][0].float() + parts[1][0].float(), whole.float()) < 1e-5
    # a router that always picks experts 0..3: the upper half's contribution is exactly zero
    b_low = b.clone()
    b_low[:4] = 100.0
    x = torch.randn(1, d, device=DEV, dtype=torch.bfloat16)
    upper, ids, _ = fused.decode_layer(x, w, b_low, K, halves[1], halves[1].layer_barrier)
    assert sorted(ids[0].tolist()) == [0, 1, 2, 3] and torch.equal(upper, torch.zeros_like(upper))
    lower, _, _ = fused.decode_layer(x, w, b_low, K, halves[0], halves[0].layer_barrier)
    assert calc_diff(lower, fused.decode_layer(x, w, b_low, K, fp8, fp8.layer_barrier)[0]) < 1e-6


def test_routed_forward_takes_it_for_one_token_only(experts20, monkeypatch):
    fp8, _ = experts20
    w, b = router(E20, fp8.hidden, 6)
    monkeypatch.setattr(fp8, "fused_decode_layer", True)
    x = torch.randn(1, fp8.hidden, device=DEV, dtype=torch.bfloat16)
    assert torch.equal(fp8.routed_forward(x, w, b, K), fused.decode_layer(x, w, b, K, fp8, fused.new_barrier(DEV))[0])
    x2 = torch.randn(2, fp8.hidden, device=DEV, dtype=torch.bfloat16)
    monkeypatch.setattr(fp8, "fused_decode_layer", False)
    split = fp8.routed_forward(x2, w, b, K)
    monkeypatch.setattr(fp8, "fused_decode_layer", True)
    assert torch.equal(fp8.routed_forward(x2, w, b, K), split)


def test_graphs_with_and_without_pdl_replay_the_eager_call(experts20, monkeypatch):
    """The layer after a norm (a Triton PDL launch) captured with PDL and without: replays on fresh inputs equal
    the eager call bit for bit (a launch reading its input early would see the last replay's token)."""
    from kernels import layers, pdl

    fp8, _ = experts20
    monkeypatch.setattr(fp8, "fused_decode_layer", True)
    w, b = router(E20, fp8.hidden, 7)
    src = torch.randn(1, fp8.hidden, device=DEV, dtype=torch.bfloat16)
    norm_w = torch.rand(fp8.hidden, device=DEV) + 0.5

    def chain():
        return layers.rms_norm(fp8.routed_forward(layers.rms_norm(src, norm_w, 1e-5), w, b, K), norm_w, 1e-5)

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
            for _ in range(3):  # back-to-back replays: the barrier state carries over
                graphs[on].replay()
            torch.cuda.synchronize()
            assert torch.equal(outs[on], eager), f"PDL {on}"
