"""The MXFP4 decode GEMM's fused epilogues (csrc/mxfp4_decode.cu, kernels/moe/mxfp4_cuda.py): SwiGLU in the
gate_up GEMM and the combine in the down GEMM, each against the separate kernel it replaces run on the
plain GEMM's output (mxfp4_decode_layer.swiglu_bf16, epilogues_triton.combine), on 20b shapes at T = 1, 3, 8, 16
with random routings, on expert-parallel slices (pairs off this rank, a token with none, a call with no active
expert), in every kernel kind, twice on one
set of tickets (each call leaves them zero) and inside a replayed CUDA graph.

The SwiGLU's exp and division are CUDA's (expf, IEEE division) and Triton's in the separate kernel, so the two
may differ by one bf16 step on a few elements; the combine is the same fp32 operations in the same order.
"""

from __future__ import annotations

import pytest
import torch

from kernels.moe import mxfp4_cuda as mc
from tests.kernels.test_mxfp4_cuda import D, I, TOP_K, _case, _experts

ALPHA, LIMIT = 1.702, 7.0
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
CONFIGS = (None, dict(tiles_per_block=2, k_splits=3, depth=8), dict(tiles_per_block=8, k_splits=1),
           dict(tiles_per_block=2, k_splits=3, kind=1, chunks_per_piece=2), dict(tiles_per_block=4, k_splits=3, kind=2,
                                                                                depth=8))


def test_unknown_epilogue_and_too_many_tokens_are_refused():
    """Checked before the extension is built (CPU tensors suffice)."""
    packed = {"words": torch.zeros(1, 1, 1, 32, 4, dtype=torch.int32), "scales": torch.zeros(1, 1, 1, 8, dtype=torch.int32),
              "n": 16, "k": 64}
    a = torch.zeros(1, 64, dtype=torch.bfloat16)
    out = torch.zeros(1, 16, dtype=torch.bfloat16)
    z = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="SwigluEpilogue or a CombineEpilogue"):
        mc.grouped_gemm_decode_mxfp4_mma(a, packed, out, z, z, z, 1, 1, pdl=False, epilogue=("swiglu",))
    t = mc.DECODE_MAX_TOKENS + 1
    ids = torch.zeros(t, TOP_K, dtype=torch.int32)
    co = mc.CombineEpilogue(torch.zeros(t, 16, dtype=torch.bfloat16), ids.flatten(), ids, ids.float(),
                            torch.zeros(1, 16), z, mc.combine_tickets(16), 0)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        mc.grouped_gemm_decode_mxfp4_mma(a, packed, out, z, z, z, 1, 1, pdl=False, epilogue=co)


def test_tickets_cover_every_row_block_and_token():
    n = 2880
    tiles = mc.CONFIG["tiles_per_block"]
    assert mc.combine_tickets(n).numel() == -(-n // (16 * tiles)) * mc.DECODE_MAX_TOKENS
    assert mc.combine_tickets(n, config=dict(tiles_per_block=1)).numel() == 180 * mc.DECODE_MAX_TOKENS
    assert not mc.combine_tickets(n).any()


def _bf16_steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in bf16 steps of want (bf16 values)."""
    w = want.float()
    step = torch.exp2(torch.floor(torch.log2(w.abs().clamp(min=2.0 ** -126))) - 7)
    return (got.float() - w).abs() / step


@pytest.fixture(scope="module")
def experts20():
    gen = torch.Generator(device="cuda").manual_seed(21) if torch.cuda.is_available() else None
    if gen is None:
        pytest.skip("needs an NVIDIA GPU")
    b13 = torch.randn(32, 2 * I, device="cuda", generator=gen) * 0.5
    b2 = torch.randn(32, D, device="cuda", generator=gen) * 0.5
    return {"gate_up": _experts(32, 2 * I, D, 0), "down": _experts(32, D, I, 1), "b13": b13, "b2": b2}


def _plan_slice(t: int, seed: int, first: int, local: int):
    """Random top-4 routing over 32 experts, planned for the slice [first, first + local): the plan, the
    token rows x [t, D], the ids / fp32 weights and the masked row -> token map."""
    from kernels.moe.routing_triton import plan_masked

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.stack([torch.randperm(32, device=dev, generator=gen)[:TOP_K] for _ in range(t)]).int()
    if local < 32:  # the last token has no pair on this rank: its output must be zeros
        outside = [e for e in range(32) if not first <= e < first + local]
        ids[-1] = torch.tensor(outside[:TOP_K], device=dev, dtype=torch.int32)
    weights = torch.softmax(torch.randn(t, TOP_K, device=dev, generator=gen), -1)
    plan = plan_masked(ids, first, local, t)
    rows = plan.row_of_pair.long()
    mine = rows >= 0
    token = (torch.arange(t * TOP_K, device=dev) // TOP_K)
    row_map = torch.zeros(local * t, dtype=torch.int32, device=dev)
    row_map[rows[mine]] = token[mine].int()
    x = torch.randn(t, D, device=dev, generator=gen).bfloat16()
    return plan, x, ids, weights, row_map


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 8, 16])
def test_swiglu_epilogue_matches_the_separate_kernel(experts20, t):
    from kernels.moe.mxfp4_decode_layer import swiglu_bf16, swiglu_bf16_reference

    blocks, scales, packed = experts20["gate_up"]
    b13 = experts20["b13"]
    plan, x, a, row_map = _case(32, D, t, seed=40 + t)
    rows = plan.row_of_pair.long()
    expert_of_row = torch.div(rows, t, rounding_mode="floor")
    ids = expert_of_row.int()  # first_expert 0: the pair's expert is its row's group
    for config in CONFIGS:
        h = torch.full((32 * t, 2 * I), float("nan"), device="cuda", dtype=torch.bfloat16)
        mc.grouped_gemm_decode_mxfp4_mma(x, packed, h, plan.counts, plan.active, plan.num_active, t, t,
                                         a_row_map=row_map, config=config)
        want = swiglu_bf16(h, plan.row_of_pair, ids, b13, 0, ALPHA, LIMIT,
                           torch.full((32 * t, I), float("nan"), device="cuda", dtype=torch.bfloat16))[rows]
        twin = swiglu_bf16_reference(h[rows], b13[expert_of_row], ALPHA, LIMIT)
        act = torch.full((32 * t, I), float("nan"), device="cuda", dtype=torch.bfloat16)
        mc.grouped_gemm_decode_mxfp4_mma(x, packed, act, plan.counts, plan.active, plan.num_active, t, t,
                                         a_row_map=row_map, config=config,
                                         epilogue=mc.SwigluEpilogue(b13, ALPHA, LIMIT))
        got = act[rows]
        assert torch.isfinite(got).all()  # every routed row written
        for other in (want, twin):
            steps = _bf16_steps(got, other)
            off = (steps > 0).float().mean().item()
            assert steps.max().item() <= 1 and off < 2e-3, (config, steps.max().item(), off)


def _combine_case(experts20, t: int, seed: int, first: int, local: int, config):
    from kernels.moe import epilogues_triton as epi

    blocks, scales, packed = experts20["down"]
    sl = dict(packed, words=packed["words"][first:first + local], scales=packed["scales"][first:first + local])
    b2 = experts20["b2"][first:first + local]
    plan, x, ids, weights, row_map = _plan_slice(t, seed, first, local)
    a = torch.randn(local * t, I, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).bfloat16()
    y = torch.full((local * t, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    mc.grouped_gemm_decode_mxfp4_mma(a, sl, y, plan.counts, plan.active, plan.num_active, t, t, config=config)
    want = epi.combine(y, plan.row_of_pair, ids, weights, b2, first, torch.empty(t, D, device="cuda",
                                                                                   dtype=torch.bfloat16))
    return sl, b2, plan, a, ids, weights, row_map, y, want


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t,first,local", [(1, 0, 32), (3, 0, 32), (8, 0, 32), (16, 0, 32), (5, 8, 16), (3, 28, 4),
                                           (1, 28, 4)])
def test_combine_epilogue_matches_combine(experts20, t, first, local):
    for config in CONFIGS:
        sl, b2, plan, a, ids, weights, row_map, y, want = _combine_case(experts20, t, 60 + t, first, local, config)
        tickets = mc.combine_tickets(D, "cuda", config)
        for _ in range(2):  # the second call finds the tickets zero again
            y2 = torch.full_like(y, float("nan"))
            out = torch.full((t, D), float("nan"), device="cuda", dtype=torch.bfloat16)
            co = mc.CombineEpilogue(out, plan.row_of_pair, ids, weights, b2, row_map, tickets, first)
            mc.grouped_gemm_decode_mxfp4_mma(a, sl, y2, plan.counts, plan.active, plan.num_active, t, t,
                                             config=config, epilogue=co)
            rows = plan.row_of_pair.long()
            rows = rows[rows >= 0]
            assert torch.equal(y2[rows], y[rows])  # the rows themselves as the plain GEMM writes them
            assert torch.isfinite(out).all()  # every token written
            if local < 32:
                assert not out[-1].any()  # no pair on this rank (with T = 1: no active expert at all)
            steps = _bf16_steps(out, want)
            off = (steps > 0).float().mean().item()
            assert steps.max().item() <= 1 and off < 1e-3, (config, steps.max().item(), off)
            assert not tickets.any()


@gpu
@pytest.mark.gpu
def test_combine_epilogue_in_a_replayed_graph(experts20):
    t, first, local = 4, 0, 32
    sl, b2, plan, a, ids, weights, row_map, y, _ = _combine_case(experts20, t, 80, first, local, None)
    tickets = mc.combine_tickets(D, "cuda")
    out = torch.empty(t, D, device="cuda", dtype=torch.bfloat16)

    def run():
        co = mc.CombineEpilogue(out, plan.row_of_pair, ids, weights, b2, row_map, tickets, first)
        mc.grouped_gemm_decode_mxfp4_mma(a, sl, y, plan.counts, plan.active, plan.num_active, t, t, epilogue=co)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # PDL on while capturing
        run()
    for seed in (81, 82):
        _, _, plan2, a2, ids2, weights2, row_map2, _, want = _combine_case(experts20, t, seed, first, local, None)
        for dst, src in ((plan.counts, plan2.counts), (plan.active, plan2.active), (plan.num_active, plan2.num_active),
                         (plan.row_of_pair, plan2.row_of_pair), (a, a2), (ids, ids2), (weights, weights2),
                         (row_map, row_map2)):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        steps = _bf16_steps(out, want)
        assert steps.max().item() <= 1 and (steps > 0).float().mean().item() < 1e-3
        assert not tickets.any()
