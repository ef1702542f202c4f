"""The CUDA C++ FP8 decode GEMM (kernels/moe/fp8_decode_cuda.py, csrc/fp8_decode.cu).

CPU: importing builds nothing; bad token counts are refused before any launch. GPU: the kernel against its
twin (`fp8_reference.grouped_gemm`: dequantized A and W, fp32 sums) on 20b and 120b expert shapes at
T = 1, 3, 5, 8 with random top-4 routings (most experts at count 0), bf16 output and fp32 split-K partials
(splits that do not divide the 23 K blocks), the masked layout and token rows through a_row_map (bitwise the
same), awkward shapes (N not a multiple of 128, Kp of two blocks), every ring depth, PDL on and off, and a
CUDA graph replayed on a fresh routing. Rows the routing does not reach stay NaN.
"""

from __future__ import annotations

import pytest
import torch

from kernels.moe import fp8_decode_cuda as fc

TOP_K = 4


def test_import_builds_nothing():
    """In a fresh interpreter (tests run before this one in this process may have built it)."""
    import subprocess
    import sys

    code = "import kernels.moe.fp8_decode_cuda as fc; assert fc._extension.cache_info().currsize == 0"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_refuses_more_tokens_than_one_column_tile():
    from kernels.moe.epilogues_triton import Fp8Rows

    a = Fp8Rows.empty(4, 9, 128, "cpu")
    z = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="1..8 rows per expert"):
        fc.grouped_gemm_decode_cuda(a, torch.empty(0), torch.empty(0), torch.empty(0), z, z, z[:1], 9)


# ---- GPU ----------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
D = I = 2880


def _calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def _weights(e: int, n: int, k: int, seed: int):
    from kernels.moe.fp8_quant import quantize_weight_blocks

    gen = torch.Generator(device="cuda").manual_seed(seed)
    return quantize_weight_blocks(torch.randn(e, n, k, device="cuda", generator=gen) * k ** -0.5)


def _case(e: int, kp: int, t: int, seed: int):
    """Random top-4 routing of t tokens over e experts: the plan, token rows (one Fp8Rows group of t), the
    same rows in the masked layout, and the row map (masked row -> token)."""
    from kernels.moe.epilogues_triton import Fp8Rows
    from kernels.moe.routing_triton import plan_masked

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.stack([torch.randperm(e, device=dev, generator=gen)[:TOP_K] for _ in range(t)]).int()
    plan = plan_masked(ids, 0, e, t)
    kb = kp // 128
    q = (torch.randn(t, kp, device=dev, generator=gen) * 60).to(torch.float8_e4m3fn)
    s = torch.rand(t, kb, device=dev, generator=gen) * 0.02 + 0.001
    tokens = Fp8Rows.empty(1, t, kp, dev)
    tokens.data.copy_(q)
    tokens.scale_storage[0, :, :t] = s.T
    masked = Fp8Rows.empty(e, t, kp, dev)
    masked.data.zero_()
    masked.scale_storage.zero_()
    rows = plan.row_of_pair.long()
    token = torch.arange(t * TOP_K, device=dev) // TOP_K
    masked.data[rows] = q[token]
    masked.scale_storage[rows // t, :, rows % t] = s[token]
    row_map = torch.zeros(e * t, dtype=torch.int32, device=dev)
    row_map[rows] = token.int()
    return plan, tokens, masked, row_map


def _out(e: int, t: int, n: int, splits: int) -> torch.Tensor:
    shape = (e * t, n) if splits == 1 else (splits, e * t, n)
    return torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16 if splits == 1 else torch.float32)


def _check(out, w, ws, plan, masked, t):
    from kernels.moe import fp8_reference as ref

    e = w.shape[0]
    expert_of_row = torch.full((e * t,), -1, device="cuda")
    for x, c in enumerate(plan.counts.tolist()):
        expert_of_row[x * t: x * t + c] = x
    valid = expert_of_row >= 0
    got = out if out.dim() == 2 else out.sum(0)
    assert torch.isfinite(got[valid]).all() and got[~valid].isnan().all()  # routed rows only
    want = ref.grouped_gemm(masked.data, masked.scales_rows(), w, ws, expert_of_row)
    assert _calc_diff(got[valid].float(), want[valid].float()) < 1e-5
    err = (got[valid].float() - want[valid].float()).abs().max().item()
    assert err <= 2 ** -7 * want[valid].float().abs().max().item()  # bf16 rounding of the twin (and of out)


@pytest.fixture(scope="module")
def weights():
    return {"20b gate_up": _weights(32, 2 * I, D, 0), "20b down": _weights(32, D, I, 1),
            "120b down": _weights(128, D, I, 2)}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t,splits", [(1, 4), (1, 1), (3, 4), (5, 1), (8, 1), (8, 3)])
@pytest.mark.parametrize("shape", ["20b gate_up", "20b down", "120b down"])
def test_kernel_matches_twin(weights, shape, t, splits):
    w, ws = weights[shape]
    e, n, kp = w.shape
    plan, tokens, masked, row_map = _case(e, kp, t, seed=10 * t + splits)
    assert int((plan.counts == 0).sum()) > 0  # experts without tokens are skipped
    for depth, load in ((2, 0), (3, 1), (4, 2)):
        out = _out(e, t, n, splits)
        fc.grouped_gemm_decode_cuda(masked, w, ws, out, plan.counts, plan.active, plan.num_active, t,
                                    config=dict(depth=depth, load=load))
        _check(out, w, ws, plan, masked, t)
        out_map = _out(e, t, n, splits)
        fc.grouped_gemm_decode_cuda(tokens, w, ws, out_map, plan.counts, plan.active, plan.num_active, t,
                                    a_row_map=row_map, config=dict(depth=depth, load=load))
        assert torch.equal(out_map.nan_to_num(-1.0), out.nan_to_num(-1.0))  # the same sums, bit for bit


@gpu
@pytest.mark.gpu
def test_awkward_shapes_pdl_and_grid_sizes():
    """N = 48 (a partial 128-row scale block), Kp = 256 (two K blocks), 5 experts, one block per slot."""
    e, n, kp, t = 5, 48, 256, 3
    w, ws = _weights(e, n, kp, 3)
    plan, tokens, masked, _ = _case(e, kp, t, seed=3)
    for pdl in (False, True):
        for splits, config in ((1, None), (2, dict(blocks_per_sm=0)), (2, dict(depth=2))):
            out = _out(e, t, n, splits)
            fc.grouped_gemm_decode_cuda(masked, w, ws, out, plan.counts, plan.active, plan.num_active, t,
                                        config=config, pdl=pdl)
            _check(out, w, ws, plan, masked, t)


@gpu
@pytest.mark.gpu
def test_cuda_graph_replays_fresh_routing(weights):
    w, ws = weights["20b down"]
    e, n, kp = w.shape
    t = 4
    plan, tokens, masked, row_map = _case(e, kp, t, seed=11)
    out = _out(e, t, n, 4)

    def run():
        fc.grouped_gemm_decode_cuda(tokens, w, ws, out, plan.counts, plan.active, plan.num_active, t,
                                    a_row_map=row_map)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # PDL on by default while capturing
        run()
    plan2, tokens2, masked2, row_map2 = _case(e, kp, t, seed=12)
    for dst, src in ((plan.counts, plan2.counts), (plan.active, plan2.active), (plan.num_active, plan2.num_active),
                     (tokens.data, tokens2.data), (tokens.scale_storage, tokens2.scale_storage), (row_map, row_map2)):
        dst.copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, w, ws, plan2, masked2, t)
