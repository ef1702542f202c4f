"""Rounding fp32 to bf16 inside Triton kernels, where a kernel must round exactly as torch would.

`v.to(tl.bfloat16).to(tl.float32)` was optimized away on the H200 (Triton 3.6, 2026-11-30: 23% of
rotary outputs one bf16 step off torch's: bench/results/rotary_bf16_rounding_before_fix_h200.log), so the rounding is done on the bits: round to nearest
even on the upper 16 bits of the fp32 pattern. Integer ops also keep the compiler from contracting
a product into the following sum (FMA). NaN payloads are not preserved (no NaNs reach these paths).
"""

import triton
import triton.language as tl


@triton.jit
def round_to_bf16(v):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


__all__ = ["round_to_bf16"]
