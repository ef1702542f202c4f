"""The MXFP4 decode experts (kernels/moe/mxfp4_decode_layer.py) and how they get into a model.

CPU: the layer's twin against TorchExperts on the dequantized weights; Fp8Experts.attach_mxfp4's checks; the
checkpoint loader keeping the MXFP4 experts (and refusing checkpoints without them); the settings' checks.
(The SwiGLU kernel runs under Triton's interpreter in moe_interpreter_cases.py.)
GPU: the layer on 20b shapes against its twin, and against the bf16 reference closer than the FP8 path gets;
routed_forward taking it; a CUDA graph replaying it on fresh tokens.
"""

from __future__ import annotations

import pytest
import torch

from kernels.moe import mxfp4_decode_layer as mdl
from kernels.moe.fp8_experts import Fp8Experts
from kernels.moe.fp8_quant import Fp8LayoutError
from kernels.moe.reference import TorchExperts, route
from model.mxfp4 import dequantize_mxfp4, quantize_mxfp4

ALPHA, LIMIT, TOP_K = 1.702, 7.0, 4


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def mxfp4_experts(e: int, hidden: int, inter: int, device="cpu", seed: int = 0):
    """Random experts as MXFP4 blocks/scales (checkpoint layout) and fp32 biases."""
    g = torch.Generator(device=device).manual_seed(seed)
    gb, gs = quantize_mxfp4(torch.randn(e, 2 * inter, hidden, device=device, generator=g) * hidden ** -0.5)
    db, ds = quantize_mxfp4(torch.randn(e, hidden, inter, device=device, generator=g) * inter ** -0.5)
    b13 = torch.randn(e, 2 * inter, device=device, generator=g) * 0.1
    b2 = torch.randn(e, hidden, device=device, generator=g) * 0.1
    return gb, gs, b13, db, ds, b2


def torch_experts(gb, gs, b13, db, ds, b2, first: int, dtype) -> TorchExperts:
    e, two_i, hidden = gb.shape[0], gb.shape[1], db.shape[1]
    te = TorchExperts(e, first, hidden, two_i // 2, ALPHA, LIMIT, dtype, gb.device)
    with torch.no_grad():
        te.gate_up_proj.copy_(dequantize_mxfp4(gb, gs, dtype))
        te.down_proj.copy_(dequantize_mxfp4(db, ds, dtype))
        te.gate_up_proj_bias.copy_(b13)
        te.down_proj_bias.copy_(b2)
    return te


@pytest.mark.parametrize("t,first", [(1, 0), (5, 0), (3, 2)])
def test_twin_matches_torch_experts(t, first):
    gb, gs, b13, db, ds, b2 = mxfp4_experts(6, 96, 64)
    x = torch.randn(t, 96).bfloat16()
    ids, weights = route(torch.randn(t, 8), TOP_K)  # ids 0..7: with first = 2, pairs of experts 0, 1 are not ours
    ids = ids.int()
    got = mdl.decode_experts_reference(x, ids, weights, gb, gs, b13, db, ds, b2, first, ALPHA, LIMIT)
    want = torch_experts(gb, gs, b13, db, ds, b2, first, torch.float32)(x.float(), ids, weights)
    assert got.dtype == torch.bfloat16
    assert calc_diff(got, want) < 1e-4  # the twin's bf16 roundings; fp32 TorchExperts rounds none


def test_attach_checks_shapes_and_token_limit():
    gb, gs, b13, db, ds, b2 = mxfp4_experts(3, 64, 96)
    m = Fp8Experts.from_mxfp4(gb, gs, b13, db, ds, b2, 0, ALPHA, LIMIT)
    with pytest.raises(Fp8LayoutError, match="1..16"):
        m.attach_mxfp4(gb, gs, db, ds, 17)
    with pytest.raises(Fp8LayoutError, match="down blocks"):
        m.attach_mxfp4(gb, gs, db[:, :32], ds[:, :32], 4)  # 32 output rows, the layer has 64
    with pytest.raises(Fp8LayoutError, match="gate_up blocks"):
        m.attach_mxfp4(gb[:2], gs[:2], db, ds, 4)
    assert "mxfp4" not in repr(m)
    m.attach_mxfp4(gb, gs, db, ds, 4)
    words13, words2 = m.mx13_words, m.mx2_words
    assert m.mxfp4_max_tokens == 4 and "mxfp4_max_tokens=4" in repr(m)
    # [E, row tiles of 16, chunks of 64 K, lanes, 4 words] (kernels/moe/mxfp4_cuda.pack_mma_words)
    assert words13.shape == (3, 12, 1, 32, 4) and words2.shape == (3, 4, 2, 32, 4)
    # the packed copy is a module buffer: counted with the weights, moved with the module, not saved
    assert any(n == "mx2_words" for n, _ in m.named_buffers()) and "mx2_words" not in m.state_dict()


def test_loader_keeps_the_mxfp4_experts(tmp_path):
    from model.convert import load_fp8_experts, main_convert
    from model.loader import CheckpointError
    from model.tiny import make_tiny

    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tiny(src, mxfp4=True, num_hidden_layers=2, num_local_experts=4, hidden_size=96, intermediate_size=64,
              vocab_size=512)
    plain = load_fp8_experts(src, device="cpu")
    kept = load_fp8_experts(src, device="cpu", mxfp4_decode_max_tokens=4)
    for a, b in zip(plain, kept):
        for name in ("w13", "s13", "w2", "s2", "b13", "b2"):
            assert torch.equal(getattr(a, name).float(), getattr(b, name).float()), name
        assert b.mxfp4_max_tokens == 4 and a.mxfp4_max_tokens == 0
    assert sum(t.numel() for t in kept[0].buffers()) > sum(t.numel() for t in plain[0].buffers())
    assert main_convert([str(src), str(dst), "--device", "cpu", "--quiet"]) == 0
    with pytest.raises(CheckpointError, match="MXFP4 experts"):
        load_fp8_experts(dst, device="cpu", mxfp4_decode_max_tokens=4)


def test_settings_refuse_what_cannot_run():
    from engine.config import EngineConfig, EngineConfigError
    from engine.model_factory import ModelFactoryError, build_model
    from model.config import GptOssConfig
    from serve_app.config import ServeAppConfig

    for bad in (-1, 17, True, 2.0):
        with pytest.raises(EngineConfigError, match="mxfp4_decode_max_tokens"):
            EngineConfig(device="cuda", mxfp4_decode_max_tokens=bad)
    with pytest.raises(EngineConfigError, match="needs device 'cuda'"):
        EngineConfig(device="cpu", mxfp4_decode_max_tokens=4)
    with pytest.raises(EngineConfigError, match="FP8 MoE"):
        EngineConfig(device="cuda", moe_backend="torch", mxfp4_decode_max_tokens=4)
    assert EngineConfig(device="cuda", mxfp4_decode_max_tokens=4).mxfp4_decode_max_tokens == 4
    cfg = GptOssConfig(num_hidden_layers=1, num_local_experts=4, vocab_size=64, hidden_size=64, intermediate_size=64,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    with pytest.raises(ModelFactoryError, match="CUDA device"):
        build_model(cfg, "cpu", random_weights=True, mxfp4_decode_max_tokens=4)
    app = ServeAppConfig(model="/models/gpt-oss-20b", mxfp4_decode_max_tokens=4)
    assert app.engine_config("cuda").mxfp4_decode_max_tokens == 4
    assert app.engine_config("cpu").mxfp4_decode_max_tokens == 0  # CPU replicas run the torch twins
    assert app.engine_config("cuda", "prefill").mxfp4_decode_max_tokens == 0  # prompts only: no copy held
    random = ServeAppConfig(model="random:gpt-oss-20b", device="cuda", mxfp4_decode_max_tokens=4)
    assert random.engine_config("cuda", "prefill").mxfp4_decode_max_tokens == 4  # the same random draw as decode


# ---- GPU ----------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
D = I = 2880
E20 = 32


@pytest.fixture(scope="module")
def layer20():
    """A 20b-shaped layer: FP8 experts converted from MXFP4 ones, the MXFP4 copy attached, a router."""
    weights = mxfp4_experts(E20, D, I, "cuda", seed=3)
    m = Fp8Experts.from_mxfp4(*weights, 0, ALPHA, LIMIT, device="cuda", backend="triton")
    gb, gs, _, db, ds, _ = weights
    m.attach_mxfp4(gb, gs, db, ds, 16)
    g = torch.Generator(device="cuda").manual_seed(4)
    router_w = (torch.randn(E20, D, device="cuda", generator=g) * D ** -0.5).bfloat16()
    router_b = (torch.randn(E20, device="cuda", generator=g) * 0.1).bfloat16()
    return m, weights, router_w, router_b


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 4, 16])
def test_layer_matches_twin_and_beats_fp8_against_the_reference(layer20, t):
    from kernels.moe import decode_front_triton as front

    m, (gb, gs, b13, db, ds, b2), router_w, router_b = layer20
    x = torch.randn(t, D, device="cuda").bfloat16()
    ids, weights, plan, _ = front.decode_front(x, router_w, router_b, TOP_K, 0, E20, m.w13.shape[2],
                                               front.new_ticket("cuda"))
    got = mdl.decode_experts(x, ids, weights, plan, *m._mxfp4_packed(), m.b13, m.b2, 0, ALPHA, LIMIT)
    twin = mdl.decode_experts_reference(x, ids, weights, gb, gs, b13, db, ds, b2, 0, ALPHA, LIMIT)
    assert torch.isfinite(got).all() and calc_diff(got, twin) < 1e-5, calc_diff(got, twin)
    m.mxfp4_max_tokens = 16
    assert torch.equal(m.routed_forward(x, router_w, router_b, TOP_K), got)  # routed_forward takes this path
    m.mxfp4_max_tokens = 0
    fp8 = m.routed_forward(x, router_w, router_b, TOP_K)  # the FP8 path: FP8 activations too
    m.mxfp4_max_tokens = 16
    reference = torch_experts(gb, gs, b13, db, ds, b2, 0, torch.bfloat16)(x, ids.long(), weights)
    mx_err, fp8_err = calc_diff(got, reference), calc_diff(fp8, reference)
    print(f"T={t}: 1 - cos-like vs the bf16 reference: MXFP4 path {mx_err:.2e}, FP8 path {fp8_err:.2e}")
    assert mx_err < 1e-4 and mx_err < fp8_err / 4


@gpu
@pytest.mark.gpu
def test_cuda_graph_replays_the_layer_on_fresh_tokens(layer20):
    m, _, router_w, router_b = layer20
    t = 4
    x = torch.randn(t, D, device="cuda").bfloat16()
    m.routed_forward(x, router_w, router_b, TOP_K)  # compiles the Triton kernels and builds the extension
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # PDL launches while capturing
        out = m.routed_forward(x, router_w, router_b, TOP_K)
    for seed in (5, 6):
        x.copy_(torch.randn(t, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, m.routed_forward(x, router_w, router_b, TOP_K))


def test_the_mxfp4_copy_is_refused_where_it_does_not_fit():
    """Before any weight is read: 120b on one H200 would need both expert copies (~179 GB); 20b fits. The
    estimate matches what the H200 runs recorded (20b experts 19.57 GB FP8, 29.72 GB with the copy:
    bench/results/e2e_h200_20b_mxfp4_{0,4}.json)."""
    from engine.memory_budget import weight_bytes_estimate
    from engine.model_factory import ModelFactoryError, check_mxfp4_copy_fits
    from model.config import GptOssConfig
    from model.parallel import SINGLE, Parallel

    h200 = 139_800_000_000
    small = weight_bytes_estimate(GptOssConfig.preset("gpt-oss-20b"), mxfp4_copy=True)
    assert abs(small["fp8_experts"] - 19_566_317_664) < 0.01 * 19_566_317_664
    assert abs(small["fp8_experts"] + small["mxfp4_copy"] - 29_718_663_264) < 0.01 * 29_718_663_264
    check_mxfp4_copy_fits(GptOssConfig.preset("gpt-oss-20b"), SINGLE, h200)
    with pytest.raises(ModelFactoryError, match="keeps the experts twice.*ep_size"):
        check_mxfp4_copy_fits(GptOssConfig.preset("gpt-oss-120b"), SINGLE, h200)
    # EP4 holds a quarter of the experts per GPU: both copies fit
    check_mxfp4_copy_fits(GptOssConfig.preset("gpt-oss-120b"), Parallel(tp_size=4, ep_size=4, rank=0), h200)
