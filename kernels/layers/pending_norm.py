"""A residual add + RMSNorm not computed yet, handed to the kernel that reads the norm.

At decode batch 1-2 the norm is a launch of its own on a 2880-wide row (~2.9 us of a 20b step per norm in the
replayed chain, 48 per step: bench/results/decode_timeline_20b_b1_opt_ins_h200.json) whose only reader is the
next kernel. A `PendingNorm` carries x (the residual stream), delta (the block's output) and the norm's weight;
a consumer whose kernel can compute the norm itself (decode_front_triton: the MoE front; slab_gemv_triton: QKV
on FP8 weights) takes `outputs()` buffers and writes x + delta and the norm there, every program computing the
row statistics it needs; any other consumer calls `normed()`, the one add_rms_norm launch as before. Either way
`residual()` is x + delta afterwards.

Numerics are the norm's: x + delta rounded to x's dtype, fp32 statistics, the normed row rounded once; a fused
consumer's sum of squares may add in another order (fp32), so its norm can differ from add_rms_norm's by one
rounding step of the activations' dtype.
"""

from __future__ import annotations

import torch

from kernels import layers

# False: every consumer calls normed() (the separate norm launch), to compare (bench/decode_ab's -no-norm-fusion)
FUSION = True


class PendingNorm:
    def __init__(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
        if x.dim() != 2 or delta.shape != x.shape:
            raise ValueError(f"PendingNorm: x {tuple(x.shape)} and delta {tuple(delta.shape)} must be the same [T, D]")
        self.x, self.delta, self.weight, self.eps = x, delta, weight, eps
        self._sum: torch.Tensor | None = None
        self._normed: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    def fusable(self, max_tokens: int) -> bool:
        """Whether a fused consumer may take it: bf16 rows with unit stride, 1..max_tokens of them, not yet
        computed (which device its kernel runs on is the consumer's choice)."""
        return (FUSION and self._normed is None and self.x.dtype == torch.bfloat16
                and self.delta.dtype == torch.bfloat16 and 0 < self.num_tokens <= max_tokens
                and self.x.stride(1) == 1 and self.delta.stride(1) == 1)

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum, normed) [T, D] buffers for the fused consumer to write; afterwards they are residual() and
        normed()."""
        if self._normed is not None:
            raise RuntimeError("PendingNorm: already computed")
        self._sum, self._normed = torch.empty_like(self.x), torch.empty_like(self.x)
        return self._sum, self._normed

    def normed(self) -> torch.Tensor:
        """rms_norm(x + delta), computed here (one launch) unless a consumer has done it."""
        if self._normed is None:
            self._sum, self._normed = layers.add_rms_norm(self.x, self.delta, self.weight, self.eps)
        return self._normed

    def residual(self) -> torch.Tensor:
        """x + delta: the residual stream after the add (once the norm is computed, by either path)."""
        if self._sum is None:
            self.normed()
        return self._sum


def resolve(x) -> torch.Tensor:
    """A tensor, or the norm a PendingNorm stands for."""
    return x.normed() if isinstance(x, PendingNorm) else x
