"""FP8 MoE on CPU: quantization and conversion round trips, the layout twins, the whole-layer twin
against TorchExperts, expert parallelism, the converter, and (in a subprocess) every Triton kernel
under Triton's interpreter against its twin."""

from __future__ import annotations

import re

import pytest
import torch

from kernels.moe import fp8_reference as ref
from kernels.moe.fp8_experts import Fp8Experts
from kernels.moe.fp8_quant import (FP8, FP8_MAX, dequantize_rows, dequantize_weight_blocks, mxfp4_to_fp8_blocks,
                                   padded, quantize_rows, quantize_weight_blocks)
from kernels.moe.reference import TorchExperts, route
from model.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tests.kernels.interpreter import run_cases

def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2<x,y> / (|x|^2 + |y|^2): 0 for equal tensors, scale-free (DeepGEMM's test measure)."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def random_experts(e: int, first: int, hidden: int, inter: int, seed: int = 0) -> TorchExperts:
    g = torch.Generator().manual_seed(seed)
    te = TorchExperts(e, first, hidden, inter, 1.702, 7.0, torch.float32)
    with torch.no_grad():
        for p, std in ((te.gate_up_proj, hidden ** -0.5), (te.down_proj, inter ** -0.5),
                       (te.gate_up_proj_bias, 0.1), (te.down_proj_bias, 0.1)):
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return te


# ---- quantization -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(3, 200, 96), (2, 256, 2880), (1, 5760, 160)])
def test_weight_blocks_round_trip_bf16(shape):
    w = torch.randn(shape) * 0.02
    q, s = quantize_weight_blocks(w)
    e, n, k = shape
    assert q.dtype == FP8 and q.shape == (e, n, padded(k)) and s.shape == (e, -(-n // 128), padded(k) // 128)
    assert (q[:, :, k:].float() == 0).all()  # K padding is zeros
    assert (s == torch.exp2(torch.log2(s).round())).all()  # power-of-two scales
    back = dequantize_weight_blocks(q, s, k)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus the subnormal floor of each block
    floor = s.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k] * 2 ** -9
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + floor).all()


def test_mxfp4_to_fp8_is_exact():
    w = torch.randn(3, 136, 2880) * 0.05
    w[0, :, :64] *= 40  # a block with a wide range of MXFP4 exponents
    blocks, scales = quantize_mxfp4(w)
    q, s = mxfp4_to_fp8_blocks(blocks, scales)
    assert torch.equal(dequantize_weight_blocks(q, s, 2880), dequantize_mxfp4(blocks, scales, torch.float32))


def test_fp8_steps_counts_values_between_codes():
    """fp8_steps: every float8_e4m3fn value one step from its neighbours in value order, +0 and -0 zero apart."""
    from kernels.moe.fp8_quant import fp8_steps

    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    finite = codes[~torch.isnan(codes.float())]
    ordered = finite[torch.argsort(finite.float(), stable=True)]  # -448 .. -0, +0 .. 448 (two zeros)
    steps = fp8_steps(ordered[1:], ordered[:-1])
    zeros = (ordered[1:].float() == 0) & (ordered[:-1].float() == 0)
    assert int(zeros.sum()) == 1 and (steps[zeros] == 0).all() and (steps[~zeros] == 1).all()
    assert int(fp8_steps(torch.tensor([-448.0]).to(FP8), torch.tensor([448.0]).to(FP8))) == 252


@pytest.mark.parametrize("k", [1, 200, 2880])
def test_quantize_rows(k):
    x = torch.randn(13, k) * torch.logspace(-3, 3, 13)[:, None]
    x[4] = 0  # all-zero row: finite scale, zero codes
    q, s = quantize_rows(x)
    assert q.shape == (13, padded(k)) and s.shape == (13, padded(k) // 128)
    assert torch.isfinite(s).all() and (q[4].float() == 0).all()
    amax = q.float().abs().amax(-1)
    assert (amax[torch.arange(13) != 4] <= FP8_MAX).all()
    back = dequantize_rows(q, s, k)
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + s.repeat_interleave(128, 1)[:, :k] * 2 ** -9).all()


# ---- layout twins -------------------------------------------------------------------------------
def _ids(t: int, e: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()


@pytest.mark.parametrize("t,e,first,num_local,k", [(1, 4, 0, 4, 4), (129, 32, 8, 8, 4), (517, 128, 0, 128, 4)])
def test_contiguous_layout_twin(t, e, first, num_local, k):
    ids = _ids(t, e, k)
    counts, ranks = ref.count_and_rank(ids, first, num_local)
    flat = ids.reshape(-1).long() - first
    local = (flat >= 0) & (flat < num_local)
    assert counts.sum() == local.sum()
    num_rows = ref.contiguous_rows_bound(t * k, num_local, 128)
    rows, m_indices, psum = ref.contiguous_layout(ids, ranks, counts, first, 128, num_rows)
    assert num_rows % 128 == 0 and int(psum.max()) <= num_rows
    assert (rows[~local] == -1).all()
    assert len(set(rows[local].tolist())) == int(local.sum())  # one row per pair
    assert torch.equal(m_indices[rows[local].long()], flat[local].int())
    assert int((m_indices >= 0).sum()) == int(local.sum())  # every other row is padding
    starts = psum.long() - counts.long()
    assert (starts % 128 == 0).all()  # segments start 128-aligned
    for x in range(num_local):
        assert (m_indices[starts[x]: psum[x]] == x).all()


def test_masked_layout_twin():
    ids = _ids(9, 16, 4)
    counts, ranks = ref.count_and_rank(ids, 4, 8)
    rows = ref.masked_layout(ids, ranks, 4, 8, 128)
    flat = ids.reshape(-1).long() - 4
    local = (flat >= 0) & (flat < 8)
    assert torch.equal(rows[local].long() // 128, flat[local])
    assert (rows[local].long() % 128 < counts[flat[local]].long()).all()


# ---- the whole layer ----------------------------------------------------------------------------
@pytest.mark.parametrize("t", [1, 7, 65])
def test_fp8_layer_twin_matches_torch_experts(t):
    te = random_experts(6, 0, 200, 136)
    experts = Fp8Experts.from_torch_experts(te)
    reference = experts.dequantized(torch.float32)
    x = torch.randn(t, 200).bfloat16()
    ids, weights = route(torch.randn(t, 6), 2)
    got = experts(x, ids, weights)  # CPU: the twin
    assert got.dtype == x.dtype and got.shape == x.shape
    # FP8 activations (1x128 scales) cost ~1e-3 of this measure; the weights are identical
    assert calc_diff(got, reference(x.float(), ids, weights)) < 2e-3
    # and the dequantized weights are within e4m3 rounding of the originals
    assert calc_diff(reference.gate_up_proj, te.gate_up_proj) < 1e-3


def test_expert_parallel_shards_sum_to_the_whole():
    te = random_experts(8, 0, 136, 72)
    full = Fp8Experts.from_torch_experts(te)
    shards = [Fp8Experts.from_dense(te.gate_up_proj[i:i + 4], te.gate_up_proj_bias[i:i + 4], te.down_proj[i:i + 4],
                                    te.down_proj_bias[i:i + 4], i, 1.702, 7.0) for i in (0, 4)]
    x = torch.randn(11, 136)
    ids, weights = route(torch.randn(11, 8), 4)
    parts = [s(x, ids, weights) for s in shards]
    torch.testing.assert_close(parts[0] + parts[1], full(x, ids, weights), rtol=1e-5, atol=1e-5)
    # a shard owning none of a token's experts contributes exactly zero for it
    ids_low = torch.stack([torch.randperm(4)[:2] for _ in range(5)])
    assert (shards[1](x[:5], ids_low, torch.ones(5, 2)) == 0).all()


def test_from_mxfp4_equals_from_dense_of_the_dequantized_weights():
    te = random_experts(3, 0, 128, 96)
    gu_blocks, gu_scales = quantize_mxfp4(te.gate_up_proj)
    dn_blocks, dn_scales = quantize_mxfp4(te.down_proj)
    a = Fp8Experts.from_mxfp4(gu_blocks, gu_scales, te.gate_up_proj_bias, dn_blocks, dn_scales,
                              te.down_proj_bias, 0, 1.702, 7.0)
    b = Fp8Experts.from_dense(dequantize_mxfp4(gu_blocks, gu_scales, torch.float32), te.gate_up_proj_bias,
                              dequantize_mxfp4(dn_blocks, dn_scales, torch.float32), te.down_proj_bias, 0, 1.702, 7.0)
    for name in ("w13", "s13", "w2", "s2", "b13", "b2"):
        assert torch.equal(getattr(a, name).float(), getattr(b, name).float()), name


# ---- offline conversion -------------------------------------------------------------------------
@pytest.mark.parametrize("mxfp4", [True, False])
def test_convert_round_trip(tmp_path, mxfp4):
    from model.convert import is_converted, load_fp8_experts, main_convert
    from model.loader import Checkpoint
    from model.parallel import Parallel
    from model.tiny import make_tiny

    src, dst = tmp_path / "src", tmp_path / "dst"
    config = make_tiny(src, mxfp4=mxfp4, num_hidden_layers=2, num_local_experts=4, hidden_size=96,
                       intermediate_size=64, vocab_size=512)
    assert main_convert([str(src), str(dst), "--device", "cpu", "--quiet"]) == 0
    assert is_converted(Checkpoint(dst)) and not is_converted(Checkpoint(src))
    at_load = load_fp8_experts(src, device="cpu")
    offline = load_fp8_experts(dst, device="cpu")
    assert len(offline) == config.num_hidden_layers
    for a, b in zip(at_load, offline):
        for name in ("w13", "s13", "w2", "s2", "b13", "b2"):
            assert torch.equal(getattr(a, name).float(), getattr(b, name).float()), name
    # expert parallelism reads this rank's experts only
    shard = load_fp8_experts(dst, Parallel(tp_size=1, ep_size=2, rank=1), device="cpu")[1]
    assert shard.first_expert == 2 and torch.equal(shard.w13.float(), offline[1].w13[2:].float())
    # every non-expert tensor is copied unchanged
    src_ck, dst_ck = Checkpoint(src), Checkpoint(dst)
    expert_weight = re.compile(r"mlp\.experts\.(gate_up|down)_proj(_blocks|_scales)?$")
    for name in src_ck.names():
        if expert_weight.search(name):
            assert name not in dst_ck
        else:
            assert torch.equal(src_ck.read(name), dst_ck.read(name)), name


# ---- the Triton kernels themselves, under Triton's interpreter ----------------------------------
def test_triton_kernels_under_interpreter():
    """tests/kernels/moe_interpreter_cases.py: every MoE Triton kernel against its twin (interpreter)."""
    run_cases("moe_interpreter_cases.py")


def test_segments_gemm_under_interpreter():
    """tests/kernels/moe_segments_interpreter_cases.py: the contiguous-segments grouped GEMM and the layer on it."""
    run_cases("moe_segments_interpreter_cases.py")
