"""Paged K/V storage: one pool of pages for full-attention layers, one for sliding-window layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedKVCache:
    """Per layer, K and V pages [num_blocks, block_size, kv_heads, head_dim] (FlashInfer's NHD layout).

    Layers of one kind share page ids: page p of sequence s is p in every full layer's tensor (or in
    every sliding layer's tensor), so one table per kind serves all its layers."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int
    num_full_blocks: int
    num_sliding_blocks: int

    @staticmethod
    def allocate(
        layer_is_sliding: list[bool],
        num_full_blocks: int,
        num_sliding_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> "PagedKVCache":
        k, v = [], []
        for sliding in layer_is_sliding:
            blocks = num_sliding_blocks if sliding else num_full_blocks
            shape = (blocks, block_size, kv_heads, head_dim)
            k.append(torch.zeros(shape, dtype=dtype, device=device))
            v.append(torch.zeros(shape, dtype=dtype, device=device))
        return PagedKVCache(k, v, block_size, num_full_blocks, num_sliding_blocks)

    @staticmethod
    def bytes_per_block(num_layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one page id costs across `num_layers` layers (K and V)."""
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
