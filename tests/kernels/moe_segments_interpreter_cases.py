"""The weight-streaming grouped GEMM over contiguous segments (triton_grouped_gemm.grouped_gemm_segments) and the
layer that runs it, on CPU tensors under Triton's interpreter, against their torch twins.

Not collected by the main test run: tests/kernels/test_moe_cpu.py runs this file in a subprocess with
TRITON_INTERPRET=1 (tests/kernels/interpreter.py).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_moe_cpu.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

from tests.kernels.interpreter import fresh_seed  # noqa: E402,F401  (autouse fixture)
from kernels.moe import epilogues_triton as epi  # noqa: E402
from kernels.moe import fp8_reference as ref  # noqa: E402
from kernels.moe import routing_triton as rt  # noqa: E402
from kernels.moe import triton_grouped_gemm as tgg  # noqa: E402
from kernels.moe.fp8_experts import Fp8Experts  # noqa: E402
from kernels.moe.fp8_quant import FP8, quantize_weight_blocks  # noqa: E402
from kernels.moe.reference import TorchExperts  # noqa: E402


def segment_inputs(counts: list[int], n: int, k: int, align: int = 128):
    """Weights, a contiguous plan whose experts hold `counts` rows, and A rows (NaN codes in the padding rows)."""
    e = len(counts)
    w, w_scales = quantize_weight_blocks(torch.randn(e, n, k) * 0.05)
    ids = torch.cat([torch.full((c,), x) for x, c in enumerate(counts)])[torch.randperm(sum(counts))][:, None]
    plan = rt.plan_contiguous(ids, 0, e, align)
    a = epi.Fp8Rows.empty(1, plan.num_rows, w.shape[2], "cpu")
    a.data.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN: a padding row read would poison its outputs
    a.scale_storage.fill_(float("nan"))
    valid = plan.m_indices >= 0
    a.data[valid] = (torch.randn(int(valid.sum()), w.shape[2]) * 50).to(FP8)
    a.scale_storage[0][:, :plan.num_rows][:, valid] = torch.rand(w.shape[2] // 128, int(valid.sum())) + 0.5
    return w, w_scales, plan, a, valid


@pytest.mark.parametrize("counts,block_t", [([5, 0, 70, 1], 16), ([5, 0, 70, 1], 128), ([33, 17, 0, 64], 32),
                                            ([0, 0, 3, 0], 16)])
@pytest.mark.parametrize("early", [False, True])
def test_segments_gemm_matches_twin(counts, block_t, early):
    """Every segment row against the twin; a segment longer than block_t takes several passes; padding rows are
    neither read (their NaN codes reach no output) nor written (the NaN the output started with stays)."""
    w, w_scales, plan, a, valid = segment_inputs(counts, 200, 384)
    out = torch.full((plan.num_rows, 200), float("nan"), dtype=torch.bfloat16)
    tgg.grouped_gemm_segments(a, w, w_scales, out, plan.counts, plan.psum, block_t, config={"BLOCK_N": 32},
                              plan_written_before_predecessor=early)
    want = ref.grouped_gemm(a.data, a.scales_rows(), w, w_scales, plan.m_indices)
    torch.testing.assert_close(out[valid].float(), want[valid].float(), rtol=2 ** -7, atol=1e-3)
    assert out[~valid].isnan().all()


def test_segments_gemm_skips_the_k_padding():
    """Columns from k_valid on are not read: NaN codes there change nothing, bit for bit."""
    w, w_scales, plan, a, valid = segment_inputs([3, 9, 0], 96, 300)  # Kp 384: 84 padding columns
    a.data.view(torch.uint8)[valid, 300:] = 0  # the real operand's zero padding (the weights have theirs)

    def run(w_, a_, k_valid):
        out = torch.zeros(plan.num_rows, 96, dtype=torch.bfloat16)
        return tgg.grouped_gemm_segments(a_, w_, w_scales, out, plan.counts, plan.psum, 16, config={"BLOCK_N": 32},
                                         k_valid=k_valid)[valid]

    clean = run(w, a, 300)
    assert torch.equal(run(w, a, None), clean)
    w_bad = w.clone()
    w_bad.view(torch.uint8)[:, :, 300:] = 0x7F
    assert torch.equal(run(w_bad, a, 300), clean)
    assert run(w_bad, a, None).isnan().any()


def test_segments_gemm_refuses_what_it_cannot_run():
    w, w_scales, plan, a, _ = segment_inputs([4, 4], 64, 256)
    out = torch.zeros(plan.num_rows, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_t"):
        tgg.grouped_gemm_segments(a, w, w_scales, out, plan.counts, plan.psum, 48)
    with pytest.raises(ValueError, match="one group"):
        tgg.grouped_gemm_segments(a, w, w_scales, out[:-1], plan.counts, plan.psum, 16)
    with pytest.raises(ValueError, match="k_valid"):
        tgg.grouped_gemm_segments(a, w, w_scales, out, plan.counts, plan.psum, 16, k_valid=100)


def test_block_t_rule():
    assert [tgg.segments_block_t(r) for r in (0.5, 4, 16, 31, 40, 64, 100)] == [32, 32, 32, 32, 64, 128, 128]


@pytest.mark.parametrize("num_tokens", [20, 43])
def test_fp8_experts_with_segments_match_the_twin_and_the_other_path(num_tokens, monkeypatch):
    """The layer with its contiguous GEMMs on segments against the torch twin (the GPU tests' similarity measure)
    and against the same layer on the general Triton grouped GEMM."""
    calls = []
    real = tgg.grouped_gemm_segments
    monkeypatch.setattr(tgg, "grouped_gemm_segments", lambda *a, **kw: calls.append(a[6]) or real(*a, **kw))
    e, hidden, inter, k = 6, 200, 136, 2
    te = TorchExperts(e, 0, hidden, inter, 1.702, 7.0, torch.float32)
    with torch.no_grad():
        for p, std in ((te.gate_up_proj, hidden ** -0.5), (te.down_proj, inter ** -0.5),
                       (te.gate_up_proj_bias, 0.1), (te.down_proj_bias, 0.1)):
            p.normal_(0, std)
    experts = Fp8Experts.from_torch_experts(te, backend="triton", masked_max_tokens=0)
    experts.segments_max_rows = 0  # the general Triton grouped GEMM first
    x = torch.randn(num_tokens, hidden).bfloat16()
    ids, weights = ref.topk_softmax(torch.randn(num_tokens, e), k)
    general = experts(x, ids, weights).float()
    assert not calls
    experts.segments_max_rows = 1000
    got = experts(x, ids, weights).float()
    assert calls == [tgg.segments_block_t(num_tokens * k / e)] * 2  # gate_up and down
    experts.backend = "torch"
    want = experts(x, ids, weights).float()

    def calc_diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return (1 - 2 * (a * b).sum() / (a.square().sum() + b.square().sum())).item()

    assert calc_diff(got, want) < 1e-5
    assert calc_diff(got, general) < 1e-5
