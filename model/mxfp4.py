"""MXFP4 (OCP microscaling FP4) decoding, as the published GPT-OSS checkpoints store expert weights.

`blocks` uint8 [..., G, 16] hold 32 E2M1 values per row group (low nibble first), `scales` uint8
[..., G] a shared power-of-two exponent biased by 127. Decoding follows transformers'
`integrations/mxfp4.py` operation for operation (table lookup in the target dtype, then ldexp), so
the results are bit-identical, inf and subnormal corners included.
"""

from __future__ import annotations

import torch

FP4_E2M1_VALUES = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., G, 16] uint8 + [..., G] uint8 -> [..., G * 32] in `dtype` (the last dim is the input dim)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    *prefix, groups, _ = blocks.shape
    flat = blocks.reshape(-1, 16)
    exponents = scales.reshape(-1, 1).to(torch.int32) - 127
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(flat.shape[0], 32, dtype=dtype, device=blocks.device)
    out[:, 0::2] = lut[(flat & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(flat >> 4).to(torch.int)]
    torch.ldexp(out, exponents, out=out)
    return out.view(*prefix, groups * 32)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round a float tensor [..., K] (K % 32 == 0) to MXFP4 blocks and scales (nearest value, per-32
    power-of-two scale chosen so the block's largest magnitude fits 6.0). Used to make test checkpoints."""
    *prefix, k = w.shape
    if k % 32:
        raise ValueError(f"the last dimension ({k}) must be a multiple of 32 for MXFP4")
    g = w.float().reshape(*prefix, k // 32, 32)
    amax = g.abs().amax(-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.pow(2.0, exp)[..., None]
    grid = torch.tensor(FP4_E2M1_VALUES[:8], device=w.device)
    idx = (scaled.abs()[..., None] - grid).abs().argmin(-1)  # nearest magnitude
    codes = (idx + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)
