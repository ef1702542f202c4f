"""MXFP4 decode grouped GEMM in CUDA C++ (`csrc/mxfp4_decode.cu`): the checkpoints' expert weights read
straight into mma.sync A fragments, no shared memory on the weight path.

The Triton MXFP4 kernels (`mxfp4_decode_gemm.py`) were issue-bound at 1.2-1.8 TB/s of MXFP4 bytes (~2.5
integer ops per weight in Triton's codegen, plus the layout conversions a register-built dot operand
costs), and break-even with the FP8 decode GEMM is ~1.9 TB/s (kernels/moe/NOTES.md). Here every lane of a
warp loads, per 64 K of a 16-row tile, one 16-byte vector: four words of 8 codes, one per m16n8k16 mma,
already in the order of that lane's A fragment, and turns each word into its four f16x2 registers with 11
integer ops (SASS: 6 LOP3 + 4 shifts (IMAD.SHL or SHF.L) + 1 funnel rotate per word; the pack below decides the
bit positions, `SOURCE_BITS`). Group scales are applied per 32 K to the fp32 partial of two mmas.

Measured (H200, 2026-12-01, `python -m bench.mxfp4_decode`, bench/results/mxfp4_cuda_decode_h200.json;
kernels/moe/NOTES.md, "MXFP4 decode GEMM in CUDA C++"), us per call with the weights arriving from HBM:
faster than the FP8 decode GEMM at T <= 4 (20b gate_up T=1 16.7 vs 19.6, down 11.2 vs 12.6; 0.82-0.95x
over gate_up/down, 20b/120b, T = 1 and 4), slower at T = 16 (1.19-1.23x). 2.1-2.5 TB/s of MXFP4 bytes at
T <= 4, 1.6-1.9 at T = 16 (Triton MXFP4: 1.1-1.8).

`pack_mma_words` (pure torch, CPU or GPU) re-packs checkpoint blocks/scales once at load time;
`grouped_gemm_decode_mxfp4_mma` launches the kernel (built on first use with torch's cpp_extension, CUDA
only; importing this module builds nothing). Twin: `mxfp4_decode_gemm.reference_decode_mxfp4`.
The model uses it through `mxfp4_decode_layer.py` when `EngineConfig.mxfp4_decode_max_tokens` is set (opt-in).
"""

from __future__ import annotations

import functools

import torch

ROWS = 16  # output channels of one mma A tile
CHUNK = 64  # K per lane's 16-byte load: 4 mmas of 16, 2 MXFP4 groups of 32
DECODE_MAX_TOKENS = 16  # two 8-token mma column tiles

# Where the kernel's `unpack` takes each code of A register i (0..3) from, per half (0: even K, 1: odd K):
# the bit positions in the word of (m, e0, e1), then of the sign. Register i holds row g + 8 (i % 2) and
# K 2t + 8 (i // 2) + half of the lane (g, t) = (lane // 4, lane % 4), the PTX ISA m16n8k16 A layout.
#   a0: word & 0x8E008E00;  a1: rotl(word, 13) & 0x8E008E00;
#   a2: (word << 3) & 0x0E000E00 | (word << 15) & 0x80008000;  a3: (word << 6) & ... | (word << 14) & ...
# No layout lets every register come from one shift + mask (a code's 3 magnitude bits and sign bit span
# {0, 1, 2, 6} mod 16, and at most two translates of that fit disjointly in 16 bits), so two registers take
# their magnitudes and signs from separate shifts.
SOURCE_BITS = (
    (((9, 10, 11), 15), ((25, 26, 27), 31)),
    (((28, 29, 30), 2), ((12, 13, 14), 18)),
    (((6, 7, 8), 0), ((22, 23, 24), 16)),
    (((3, 4, 5), 1), ((19, 20, 21), 17)),
)

# tiles_per_block x k_splits warps per block; kind 0 (ring): `depth` 16-byte loads in flight per warp in
# registers; kind 2 (async): `depth` slots per warp in shared memory filled by cp.async; kind 1 (bulk):
# cp.async.bulk copies of the warp's whole run, `chunks_per_piece` chunks per mbarrier.
CONFIG = dict(tiles_per_block=4, k_splits=3, depth=4, kind=0, chunks_per_piece=0)


def _lane_positions(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row [32, 4], K [32, 4, 2]) inside a 16 x 16 mma tile of lane, register (and half)."""
    lane = torch.arange(32, device=device)
    g, t = lane // 4, lane % 4
    reg = torch.arange(4, device=device)
    row = g[:, None] + 8 * (reg % 2)[None, :]
    k = (2 * t)[:, None, None] + 8 * (reg // 2)[None, :, None] + torch.arange(2, device=device)[None, None, :]
    return row, k


def pack_mma_words(blocks: torch.Tensor, scales: torch.Tensor) -> dict:
    """Checkpoint MXFP4 blocks [E, N, G, 16] uint8 + scales [E, N, G] uint8 -> {"words": [E, RT, C, 32, 4]
    int32 (RT = ceil(N / 16) row tiles, C = ceil(K / 64) chunks; lane l's 16 bytes of a chunk are the
    codes of its A fragments for the chunk's four 16-deep mmas), "scales": [E, RT, C, 8] int32 (bytes
    (row g, group 2c), (g + 8, 2c), (g, 2c + 1), (g + 8, 2c + 1) of lanes 4g..4g+3), "n", "k"}. Padding
    rows and K hold code 0 with scale byte 0 (which the kernel reads as 0.0)."""
    e, n, g, sixteen = blocks.shape
    if sixteen != 16 or scales.shape != (e, n, g):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    k = g * 32
    rt, ch = -(-n // ROWS), -(-k // CHUNK)
    dev = blocks.device
    row, kk = _lane_positions(dev)
    words = torch.empty(e, rt, ch, 32, 4, dtype=torch.int32, device=dev)
    for x in range(e):  # one expert at a time: int64 scratch of ~16 x its bytes
        codes = torch.zeros(rt * ROWS, ch * CHUNK, dtype=torch.int64, device=dev)
        codes[:n, :k] = torch.stack([blocks[x] & 0xF, blocks[x] >> 4], -1).view(n, k)  # low nibble first
        tiles = codes.view(rt, ROWS, ch, 4, 16).permute(0, 2, 3, 1, 4)  # [RT, C, mma, 16 rows, 16 K]
        lane_codes = tiles[:, :, :, row[:, :, None], kk]  # [RT, C, mma, lane, reg, half]
        word = torch.zeros(rt, ch, 4, 32, dtype=torch.int64, device=dev)
        for reg, halves in enumerate(SOURCE_BITS):
            for half, (mags, sign) in enumerate(halves):
                c = lane_codes[..., reg, half]
                for bit, pos in enumerate(mags):
                    word |= ((c >> bit) & 1) << pos
                word |= (c >> 3) << sign
        word = torch.where(word >= 2 ** 31, word - 2 ** 32, word)
        words[x] = word.permute(0, 1, 3, 2).to(torch.int32)  # [RT, C, lane, mma]
    s = torch.zeros(e, rt * ROWS, ch * 2, dtype=torch.int32, device=dev)
    s[:, :n, :g] = scales.to(torch.int32)
    s = s.view(e, rt, 2, 8, ch, 2).permute(0, 1, 4, 3, 5, 2)  # [E, RT, C, g, group in chunk, row half]
    s = s.reshape(e, rt, ch, 8, 4).to(torch.int64)
    packed = s[..., 0] | (s[..., 1] << 8) | (s[..., 2] << 16) | (s[..., 3] << 24)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return {"words": words, "scales": packed.contiguous(), "n": n, "k": k}


@functools.cache
def _extension():
    """Build (first call, or scripts/prebuild_cuda_kernels.py) and load csrc/mxfp4_decode.cu (the kernels, nvcc) and
    mxfp4_decode_binding.cpp (the torch binding, host compiler) for sm_90a."""
    from kernels import cuda_extension

    return cuda_extension.load(["mxfp4_decode.cu", "mxfp4_decode_binding.cpp"], "mxfp4_decode_ext",
                               "MXFP4_CUDA_BUILD_DIR", "mxfp4_cuda")


def build() -> str:
    """Build the extension now; returns the path of the shared object (for cuobjdump)."""
    return _extension().__file__


def grouped_gemm_decode_mxfp4_mma(a: torch.Tensor, packed: dict, out: torch.Tensor, counts: torch.Tensor,
                                  active: torch.Tensor, num_active: torch.Tensor, rows_per_group: int,
                                  max_tokens: int, a_row_map: torch.Tensor | None = None,
                                  config: dict | None = None, pdl: bool | None = None) -> torch.Tensor:
    """a [rows or T, K] bf16 (pair rows of the masked layout, or token rows through `a_row_map`) and the
    `pack_mma_words` experts -> out [E * rows_per_group, N] bf16, rows [e * rows_per_group, + counts[e]) =
    A rows @ W[e]^T for the experts active[:num_active] (other rows untouched). No host sync, no
    allocation: CUDA-graph capturable. pdl: launch with programmatic stream serialization (default: while
    a graph is being captured on an SM90 device, as kernels.pdl does for the Triton kernels)."""
    if not 0 < max_tokens <= min(DECODE_MAX_TOKENS, rows_per_group):
        raise ValueError(f"grouped_gemm_decode_mxfp4_mma covers 1..{DECODE_MAX_TOKENS} rows per expert "
                         f"(and rows_per_group {rows_per_group}); got {max_tokens}")
    if a.dtype != torch.bfloat16 or a.shape[-1] != packed["k"]:
        raise ValueError(f"A must be bf16 [*, {packed['k']}]; got {a.dtype} {tuple(a.shape)}")
    cfg = dict(CONFIG, **(config or {}))
    if pdl is None:
        from kernels import pdl as pdl_mod

        pdl = pdl_mod.active(a)
    _extension().mxfp4_mma_decode(a, packed["words"], packed["scales"], out, counts, active, num_active,
                                  a_row_map, rows_per_group, packed["n"], packed["k"], max_tokens,
                                  cfg["tiles_per_block"], cfg["k_splits"], cfg["depth"], cfg["kind"],
                                  cfg["chunks_per_piece"], bool(pdl))
    return out
