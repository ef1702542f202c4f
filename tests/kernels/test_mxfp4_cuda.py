"""The CUDA C++ MXFP4 decode GEMM (kernels/moe/mxfp4_cuda.py, csrc/mxfp4_decode.cu).

CPU: the load-time pack, checked by emulating in torch what the kernel does with it (the bit ops of its
`unpack` and scale decode, then the m16n8k16 A-fragment layout of the PTX ISA: which row and K each lane's
register halves hold) and comparing with dequantize_mxfp4 bit for bit. GPU: the kernel against its twin
(`reference_decode_mxfp4`, bf16 weights, fp32 sums) on 20b shapes at T = 1, 3, 8, 16 with random routings
(most experts at count 0), the masked layout and token rows through a_row_map, and inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from kernels.moe import mxfp4_cuda as mc
from model.mxfp4 import dequantize_mxfp4, quantize_mxfp4

M32 = 0xFFFFFFFF


def _unpack_like_kernel(w: torch.Tensor) -> list[torch.Tensor]:
    """csrc/mxfp4_decode.cu `unpack`, in int64 arithmetic on 32-bit words: four f16x2 registers."""
    mag, sign, code = 0x0E000E00, 0x80008000, 0x8E008E00
    rot13 = ((w << 13) | (w >> 19)) & M32
    return [w & code, rot13 & code, ((w << 3) & mag) | ((w << 15) & sign), ((w << 6) & mag) | ((w << 14) & sign)]


def _f16_halves(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def as_f16(bits):
        return torch.where(bits >= 2 ** 15, bits - 2 ** 16, bits).to(torch.int16).view(torch.float16).float()

    return as_f16(r & 0xFFFF), as_f16(r >> 16)


def emulate_kernel_weights(packed: dict) -> torch.Tensor:
    """The weights [E, RT * 16, C * 64] fp32 the kernel multiplies with, as each lane sees them."""
    words = packed["words"].to(torch.int64) & M32  # [E, RT, C, lane, mma]
    sw = packed["scales"].to(torch.int64) & M32  # [E, RT, C, g]
    e, rt, ch = words.shape[:3]
    dense = torch.full((e, rt * 16, ch * 64), float("nan"))
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4  # PTX ISA: groupID, threadID_in_group
    for m in range(4):
        regs = _unpack_like_kernel(words[..., m])
        for r, reg in enumerate(regs):
            # scale byte of this register's row (g or g + 8) and of the mma's MXFP4 group (2c + m // 2)
            byte = (sw[..., g] >> (8 * (2 * (m // 2) + r % 2))) & 0xFF  # [E, RT, C, lane]
            scale = (byte << 23).to(torch.int32).view(torch.float32)
            for half, value in enumerate(_f16_halves(reg)):
                i = 2 * r + half  # element a_i: row g (+8: a2 a3 a6 a7), col 2t + i % 2 (+8: a4..a7)
                row = g + 8 * ((i // 2) % 2)
                col = 2 * t + (i % 2) + 8 * (i // 4)
                rows = (torch.arange(rt) * 16)[:, None, None] + row
                cols = (torch.arange(ch) * 64 + m * 16)[None, :, None] + col
                dense[:, rows, cols] = value * 2.0 ** 14 * scale
    return dense


@pytest.mark.parametrize("e,n,k", [(3, 37, 160), (2, 48, 64), (1, 24, 2880)])
def test_pack_unpacks_to_the_dequantized_weights(e, n, k):
    g = torch.Generator().manual_seed(e * 1000 + n + k)
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
    # every exponent the kernel decodes as 2^(s - 127) (0 would be 2^-127, read as 0.0; 255 is NaN in E8M0)
    scales = torch.randint(1, 255, (e, n, k // 32), generator=g, dtype=torch.uint8)
    packed = mc.pack_mma_words(blocks, scales)
    rt, ch = -(-n // 16), -(-k // 64)
    assert packed["words"].shape == (e, rt, ch, 32, 4) and packed["scales"].shape == (e, rt, ch, 8)
    dense = emulate_kernel_weights(packed)
    want = dequantize_mxfp4(blocks, scales, torch.float32)
    got = dense[:, :n, :k]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bit for bit, signed zeros included
    pad = dense.clone()
    pad[:, :n, :k] = 0
    assert pad.abs().sum() == 0  # padding rows and K decode to exact zeros


def test_every_word_bit_is_used_once():
    bits = sorted(b for halves in mc.SOURCE_BITS for mags, sign in halves for b in (*mags, sign))
    assert bits == list(range(32))


def test_pack_rejects_mismatched_scales():
    with pytest.raises(ValueError):
        mc.pack_mma_words(torch.zeros(2, 16, 3, 16, dtype=torch.uint8), torch.zeros(2, 16, 2, dtype=torch.uint8))


def test_import_builds_nothing():
    """In a fresh interpreter (tests run before this one in this process may have built it)."""
    import subprocess
    import sys

    code = "import kernels.moe.mxfp4_cuda as mc; assert mc._extension.cache_info().currsize == 0"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- GPU ----------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
D = I = 2880
TOP_K = 4


def _calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def _experts(e: int, n: int, k: int, seed: int):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    parts = [quantize_mxfp4(torch.randn(1, n, k, device=dev, generator=gen) * k ** -0.5) for _ in range(e)]
    blocks = torch.cat([b for b, _ in parts]).view(e, n, k // 32, 16)
    scales = torch.cat([s for _, s in parts])
    return blocks, scales, mc.pack_mma_words(blocks, scales)


@pytest.fixture(scope="module")
def experts20():
    return {"gate_up": _experts(32, 2 * I, D, 0), "down": _experts(32, D, I, 1)}


def _case(e: int, k: int, t: int, seed: int):
    """Random top-4 routing of t tokens: the plan, token rows x [t, K] bf16, the masked-layout A and the
    row map (masked row -> token)."""
    from kernels.moe.routing_triton import plan_masked

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.stack([torch.randperm(e, device=dev, generator=gen)[:TOP_K] for _ in range(t)]).int()
    plan = plan_masked(ids, 0, e, t)
    x = torch.randn(t, k, device=dev, generator=gen).bfloat16()
    rows = plan.row_of_pair.long()
    token = torch.arange(t * TOP_K, device=dev) // TOP_K
    a = torch.zeros(e * t, k, device=dev, dtype=torch.bfloat16)
    a[rows] = x[token]
    row_map = torch.zeros(e * t, dtype=torch.int32, device=dev)
    row_map[rows] = token.int()
    return plan, x, a, row_map


def _check(out, blocks, scales, plan, a, t):
    from kernels.moe.mxfp4_decode_gemm import reference_decode_mxfp4

    want = reference_decode_mxfp4(a, blocks, scales, plan.counts, t)
    rows = plan.row_of_pair.long()
    got = out[rows].float()
    assert torch.isfinite(got).all()  # every routed row written (the output was NaN-poisoned)
    diff = _calc_diff(got, want[rows])
    err = (got - want[rows]).abs().max().item()
    bound = 2 ** -8 * want[rows].abs().max().item()  # bf16 output rounding
    assert diff < 1e-5 and err <= bound, (diff, err, bound)
    return diff, err


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 8, 16])
@pytest.mark.parametrize("gemm", ["gate_up", "down"])
def test_kernel_matches_twin_on_20b_shapes(experts20, gemm, t):
    blocks, scales, packed = experts20[gemm]
    e, n = blocks.shape[:2]
    plan, x, a, row_map = _case(e, D, t, seed=t)
    assert t == 16 or int((plan.counts == 0).sum()) > 0  # experts without tokens are skipped
    for config in (None, dict(tiles_per_block=2, k_splits=3, depth=8), dict(tiles_per_block=8, k_splits=1),
                   dict(tiles_per_block=2, k_splits=3, kind=1, chunks_per_piece=2),
                   dict(tiles_per_block=1, k_splits=9, kind=1, chunks_per_piece=4),
                   dict(tiles_per_block=4, k_splits=3, kind=2, depth=8),
                   dict(tiles_per_block=2, k_splits=2, kind=2, depth=6)):
        out = torch.full((e * t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        mc.grouped_gemm_decode_mxfp4_mma(a, packed, out, plan.counts, plan.active, plan.num_active, t, t,
                                         config=config)
        _check(out, blocks, scales, plan, a, t)
        out_map = torch.full_like(out, float("nan"))
        mc.grouped_gemm_decode_mxfp4_mma(x, packed, out_map, plan.counts, plan.active, plan.num_active, t, t,
                                         a_row_map=row_map, config=config)
        rows = plan.row_of_pair.long()
        assert torch.equal(out_map[rows], out[rows])


@gpu
@pytest.mark.gpu
def test_awkward_shapes_and_pdl():
    blocks, scales, packed = _experts(5, 200, 96, 7)  # N not a multiple of 16, K = 1.5 chunks
    t = 3
    plan, x, a, _ = _case(5, 96, t, seed=3)
    for pdl in (False, True):
        for config in (None, dict(k_splits=1, kind=1, chunks_per_piece=1), dict(kind=2, depth=8)):
            out = torch.full((5 * t, 200), float("nan"), device="cuda", dtype=torch.bfloat16)
            mc.grouped_gemm_decode_mxfp4_mma(a, packed, out, plan.counts, plan.active, plan.num_active, t, t,
                                             config=config, pdl=pdl)
            _check(out, blocks, scales, plan, a, t)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, dict(tiles_per_block=2, k_splits=5, kind=1, chunks_per_piece=2),
                                    dict(kind=2, depth=8)])
def test_cuda_graph_replays_fresh_routing(experts20, config):
    blocks, scales, packed = experts20["down"]
    e, n = blocks.shape[:2]
    t = 4
    plan, x, a, row_map = _case(e, I, t, seed=11)
    out = torch.full((e * t, n), float("nan"), device="cuda", dtype=torch.bfloat16)

    def run():
        mc.grouped_gemm_decode_mxfp4_mma(x, packed, out, plan.counts, plan.active, plan.num_active, t, t,
                                         a_row_map=row_map, config=config)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # PDL on by default while capturing
        run()
    plan2, x2, a2, row_map2 = _case(e, I, t, seed=12)
    for dst, src in ((plan.counts, plan2.counts), (plan.active, plan2.active), (plan.num_active, plan2.num_active),
                     (plan.row_of_pair, plan2.row_of_pair), (x, x2), (row_map, row_map2)):
        dst.copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, blocks, scales, plan2, a2, t)
