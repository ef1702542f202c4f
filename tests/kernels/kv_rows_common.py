"""Inputs shared by the kv_rows tests (CPU twin, interpreter, GPU): caches of awkward sizes, distinct
random slots per layer kind, a pad on the sliding-like entries."""

from __future__ import annotations

import torch


def make_case(rows: int, dtype: torch.dtype, layers: int, device: str = "cpu", kv_heads: int = 8,
              head_dim: int = 64, block: int = 16):
    """Per layer K and V caches (layer kinds alternate: even = sliding-like with a pad, odd = full),
    flat slots per entry, and pads. Slots are a random permutation slice, so every row lands once."""
    blocks = rows // block + 3
    caches, slots, pads = [], [], []
    for layer in range(layers):
        for _ in ("k", "v"):
            bits = torch.randint(0, 255, (blocks, block, kv_heads, head_dim * dtype.itemsize), dtype=torch.uint8)
            caches.append(bits.view(dtype).to(device) if dtype.itemsize == 1 else
                          torch.randn(blocks, block, kv_heads, head_dim).to(dtype).to(device))
            slots.append(torch.randperm(blocks * block)[:rows].to(device))
            pads.append(min(rows, 5) if layer % 2 == 0 else 0)
    return caches, slots, pads
