"""Per-step attention metadata: built once per batch by the engine, read by every layer.

A batch is a flat run of T new tokens from B sequences (`query_start_loc` splits it). Each
sequence's K/V lives in pages ("blocks") of `block_size` tokens. GPT-OSS has two kinds of layers,
and each kind has its own pool of pages and its own page tables:

- full layers keep every page of a sequence;
- sliding layers (window 128) keep only the pages that still hold one of the last 128 positions.
  Their table starts at the first live page, so the table, `kv_lens` and the kernels never see
  the freed prefix. Attention never needs absolute positions (RoPE is applied before caching):
  within the visible KV of length L, query i of n new tokens sits at index L - n + i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVGroupMeta:
    """Paging metadata of one layer kind (full or sliding) for one step."""

    block_tables: torch.Tensor  # int32 [B, max_blocks]; row b: physical pages, padded with 0
    kv_lens: torch.Tensor  # int32 [B]; tokens visible through the table after this step's writes
    slot_mapping: torch.Tensor  # int64 [T]; page * block_size + offset for each new token
    kv_lens_cpu: list[int]  # host copy of kv_lens, for planning


@dataclass
class AttentionBatch:
    """Everything attention needs for one forward over a batch of new tokens."""

    query_start_loc: torch.Tensor  # int32 [B+1]
    query_lens_cpu: list[int]
    full: KVGroupMeta | None = None  # None: no KV cache, attend only within the new tokens
    sliding: KVGroupMeta | None = None
    # Set when every sequence has one new token: the step runs the decode kernels.
    is_decode: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @property
    def has_cache(self) -> bool:
        return self.full is not None

    @staticmethod
    def without_cache(query_lens: list[int], device: torch.device | str = "cpu") -> "AttentionBatch":
        """Sequences that start at position 0 and keep no K/V: a full recompute."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return AttentionBatch(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            query_lens_cpu=list(query_lens),
            is_decode=False,
        )

    def group(self, sliding: bool) -> KVGroupMeta | None:
        return self.sliding if sliding else self.full
