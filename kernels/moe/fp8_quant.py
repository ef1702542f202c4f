"""FP8 (float8_e4m3fn) block scaling for the MoE experts, in pure torch (any device).

Two scalings, the ones DeepGEMM's SM90 grouped GEMMs read:
- weights: one fp32 scale per 128x128 block of an expert matrix [N, K];
- activations: one fp32 scale per token per 128 channels (1x128).

GPT-OSS's 2880 is not a multiple of 128, so every K dimension is padded with zeros to 2944 (23
blocks). N is never padded: the GEMMs mask the ragged last block of 2880 rows themselves, and its
scale row covers the 64 real rows only.

These functions are the torch twins of the Triton quantizers (epilogues_triton.py) and the load-time
converter (run on the GPU at load, or offline by `gptoss convert`).
"""

from __future__ import annotations

import torch

from model.mxfp4 import dequantize_mxfp4

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128
# DeepGEMM's per_token_cast_to_fp8 floors the amax the same way: an all-zero block (K padding) gets
# a tiny finite scale instead of 0/0.
AMAX_FLOOR = 1e-4
# The decode kernels that stream FP8 weights of K padded to 128s (the MoE decode GEMM, the slab and FP8 GEMVs)
# skip the zero columns past the real K (2880 of 2944: 2.2% of their bytes; the products are the same). True
# reads them as before 2026-12-03: for bench/decode_ab's same-process comparison only.
READ_K_PADDING = False


class Fp8LayoutError(ValueError):
    """A tensor handed to the FP8 MoE path has the wrong shape or dtype; the message says which."""


def fp8_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many float8_e4m3fn values apart a and b are, element-wise (int32): the codes in value order, so +0 and
    -0 are the same value (0 steps) and the smallest subnormals of either sign are one step from zero."""
    def ordered(x: torch.Tensor) -> torch.Tensor:
        c = x.view(torch.uint8).int()
        return torch.where(c >= 128, 128 - c, c)  # sign-magnitude -> a signed line (0x80 -> 0)

    return (ordered(a) - ordered(b)).abs()


def align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def padded(k: int) -> int:
    """The K dimension after padding to whole 128-blocks (2880 -> 2944)."""
    return align(k, BLOCK)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0), exactly, via the float exponent bits."""
    bits = x.float().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent.clamp(1, 254) << 23).view(torch.float32)


def quantize_weight_blocks(w: torch.Tensor, k_padded: int | None = None, pow2_scales: bool = True,
                           chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> (fp8 [E, N, Kp], fp32 scales [E, ceil(N/128), Kp/128]).

    With `pow2_scales` each block scale is a power of two: an MXFP4 weight (E2M1 value times a
    power of two) then lands on an exact float8_e4m3 value, so converting MXFP4 -> FP8 loses nothing
    unless one 128x128 block spans more than ~17 binades. Experts are processed `chunk` at a time so
    the fp32 temporaries stay small."""
    if w.dim() != 3:
        raise Fp8LayoutError(f"expert weights must be [E, N, K], got shape {tuple(w.shape)}")
    e, n, k = w.shape
    kp = padded(k) if k_padded is None else k_padded
    if kp % BLOCK or kp < k:
        raise Fp8LayoutError(f"padded K ({kp}) must be a multiple of {BLOCK} and >= K ({k})")
    np_ = align(n, BLOCK)
    q = torch.empty(e, n, kp, dtype=FP8, device=w.device)
    scales = torch.empty(e, np_ // BLOCK, kp // BLOCK, dtype=torch.float32, device=w.device)
    for lo in range(0, e, chunk):
        hi = min(e, lo + chunk)
        blk = torch.zeros(hi - lo, np_, kp, dtype=torch.float32, device=w.device)
        blk[:, :n, :k] = w[lo:hi]
        blk = blk.view(hi - lo, np_ // BLOCK, BLOCK, kp // BLOCK, BLOCK)
        amax = blk.abs().amax(dim=(2, 4)).clamp(min=AMAX_FLOOR)  # [e, N/128, Kp/128]
        s = amax / FP8_MAX
        if pow2_scales:
            s = pow2_ceil(s)
        blk = (blk / s[:, :, None, :, None]).to(FP8)
        q[lo:hi] = blk.view(hi - lo, np_, kp)[:, :n]
        scales[lo:hi] = s
    return q, scales


def dequantize_weight_blocks(q: torch.Tensor, scales: torch.Tensor, k: int | None = None,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_weight_blocks`: [E, N, Kp] fp8 -> [E, N, k] in `dtype` (K padding cut)."""
    e, n, kp = q.shape
    s = scales.repeat_interleave(BLOCK, dim=1)[:, :n].repeat_interleave(BLOCK, dim=2)
    out = q.float() * s
    return out[:, :, : (kp if k is None else k)].to(dtype)


def mxfp4_to_fp8_blocks(blocks: torch.Tensor, scales: torch.Tensor, k_padded: int | None = None,
                        chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 `_blocks` [E, N, K/32, 16] + `_scales` [E, N, K/32] -> FP8 128x128-block weights, chunk
    by chunk of experts on the tensors' device (dequantize to bf16, which holds every MXFP4 value
    exactly, then re-scale with power-of-two block scales)."""
    e = blocks.shape[0]
    n, k = blocks.shape[1], blocks.shape[2] * 32
    kp = padded(k) if k_padded is None else k_padded
    q = torch.empty(e, n, kp, dtype=FP8, device=blocks.device)
    s = torch.empty(e, align(n, BLOCK) // BLOCK, kp // BLOCK, dtype=torch.float32, device=blocks.device)
    for lo in range(0, e, chunk):
        hi = min(e, lo + chunk)
        dense = dequantize_mxfp4(blocks[lo:hi], scales[lo:hi], torch.bfloat16)
        q[lo:hi], s[lo:hi] = quantize_weight_blocks(dense, kp, pow2_scales=True, chunk=chunk)
    return q, s


def quantize_rows(x: torch.Tensor, k_padded: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-128-channel quantization: [M, K] -> (fp8 [M, Kp], fp32 scales [M, Kp/128]).

    The twin of the Triton activation quantizers: same formula (scale = max(amax, 1e-4) / 448, value
    divided by the scale, round-to-nearest-even cast), fp32 throughout."""
    m, k = x.shape
    kp = padded(k) if k_padded is None else k_padded
    v = torch.zeros(m, kp, dtype=torch.float32, device=x.device)
    v[:, :k] = x
    v = v.view(m, kp // BLOCK, BLOCK)
    s = v.abs().amax(dim=2).clamp(min=AMAX_FLOOR) / FP8_MAX
    return (v / s[:, :, None]).to(FP8).view(m, kp), s


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, k: int | None = None) -> torch.Tensor:
    m, kp = q.shape
    out = (q.float().view(m, kp // BLOCK, BLOCK) * scales[:, :, None]).view(m, kp)
    return out if k is None else out[:, :k]


def fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """x after a per-token-per-128 FP8 round trip, in fp32, same width as x."""
    q, s = quantize_rows(x.float())
    return dequantize_rows(q, s, x.shape[1])
