"""A residual add done by the kernel that produced the block's output, its RMSNorm left to the kernel reading it.

At decode batch 1-2 a residual add + RMSNorm is a launch of its own on a 2880-wide row (~2.9 us of the replayed
20b chain per norm, 48 per step: bench/results/decode_timeline_20b_b1_opt_ins_h200.json) between two kernels
that could do its work. A consumer cannot compute the norm alone cheaply: each of its programs would read whole
rows for the statistics (tried 2026-12-03: the MoE front and QKV's slab GEMV each slower by more than the norm
saved, bench/results/decode_ab_norm_fusion_full_rows_20b_h200.json). So the work is split:

- the producer (O's slab GEMV, `slab_gemv(..., residual=x)`) finishes each block of output channels by adding
  the residual x (rounded as add_rms_norm rounds) and writes sum = x + delta and, per token, the partial sums of
  squares of sum over that block: sq [T, P];
- the consumer (the MoE front, decode_front_triton) reads its slice of sum and the P partials: each token's
  statistics in one load, its slice normed as add_rms_norm norms it; it writes the norm for later readers.

A consumer that cannot do this calls `normed()`: the plain norm of sum, one launch, as before. Either way
`residual()` is x + delta. Numerics are the norm's (x + delta rounded to x's dtype, fp32 statistics, one rounding
of the normed row) but for the order in which the sum of squares adds up: the norm can differ from add_rms_norm's
by one rounding step of the activations' dtype.
"""

from __future__ import annotations

import torch

from kernels import layers

# False: no producer adds the residual (the separate add + norm launch), to compare (bench/decode_ab's
# -no-norm-fusion)
FUSION = False


class PendingNorm:
    def __init__(self, summed: torch.Tensor, sq: torch.Tensor, weight: torch.Tensor, eps: float):
        if summed.dim() != 2 or sq.dim() != 2 or sq.shape[0] != summed.shape[0] or weight.shape != (summed.shape[1],):
            raise ValueError(f"PendingNorm: sum {tuple(summed.shape)} [T, D], partial sums of squares "
                             f"{tuple(sq.shape)} [T, P] and weight {tuple(weight.shape)} [D]")
        self.summed, self.sq, self.weight, self.eps = summed, sq, weight, eps
        self._normed: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.summed.shape[0]

    def fusable(self, max_tokens: int) -> bool:
        """Whether a consumer's kernel may compute the norm: 1..max_tokens bf16 rows, not yet computed."""
        return self._normed is None and self.summed.dtype == torch.bfloat16 and 0 < self.num_tokens <= max_tokens

    def output(self) -> torch.Tensor:
        """A [T, D] buffer for the consuming kernel to write the norm into; normed() returns it afterwards."""
        if self._normed is not None:
            raise RuntimeError("PendingNorm: the norm is already computed")
        self._normed = torch.empty_like(self.summed)
        return self._normed

    def normed(self) -> torch.Tensor:
        """rms_norm(x + delta), computed here (one launch) unless a consumer has written it."""
        if self._normed is None:
            self._normed = layers.rms_norm(self.summed, self.weight, self.eps)
        return self._normed

    def residual(self) -> torch.Tensor:
        """x + delta: the residual stream after the add."""
        return self.summed


def resolve(x) -> torch.Tensor:
    """A tensor, or the norm a PendingNorm stands for."""
    return x.normed() if isinstance(x, PendingNorm) else x
