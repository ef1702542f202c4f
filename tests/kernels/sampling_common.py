"""Inputs shared by the sampling kernels' interpreter cases and GPU tests."""

from __future__ import annotations

import torch


def awkward_rows(rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random logits with the cases that decide an argmax: ties across chunks, NaNs, all -inf rows, +inf."""
    x = torch.randn(rows, vocab).to(dtype)
    if rows > 1:  # a tie between an early and a late chunk: the first wins
        x[1, 3] = x[1, vocab - 2] = 50.0
    if rows > 2:  # NaNs after a larger value: the first NaN wins
        x[2, 5] = 100.0
        x[2, vocab // 2] = x[2, vocab - 1] = float("nan")
    if rows > 3:
        x[3] = float("-inf")
    if rows > 4:
        x[4, vocab - 1] = float("inf")
    return x
