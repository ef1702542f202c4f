"""Host-side planning for the GPU attention kernels (pure torch, testable on CPU).

- `decode_num_splits`: how many KV splits the decode kernel uses for a batch.
- `flashinfer_page_lists`: the CSR page lists (indptr, indices, last_page_len) FlashInfer's paged
  wrappers take, from our padded page tables.
- `StepBuffers`: fixed-size device copies of one layer kind's per-step metadata. `fill` copies a
  step's tables in place, so kernels captured in a CUDA graph read the new step on replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention.metadata import KVGroupMeta

MAX_SPLITS = 64
# Below this many tokens per split, a split's fixed cost (q load, partial write, merge read)
# outweighs the parallelism it adds.
MIN_TOKENS_PER_SPLIT = 256


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def decode_num_splits(batch: int, max_kv_len: int, num_kv_heads: int, num_sms: int,
                      waves: int = 4, max_splits: int = MAX_SPLITS) -> int:
    """A power of two: enough (sequence, kv head, split) programs to give every SM `waves` of them,
    no split shorter than MIN_TOKENS_PER_SPLIT, at most `max_splits`.

    Under CUDA graphs pass the capacity (largest context the graph may see) as `max_kv_len`, so the
    grid is fixed per captured batch size; shorter sequences leave trailing splits empty."""
    if batch < 1 or num_kv_heads < 1:
        raise ValueError(f"decode needs batch >= 1 and kv heads >= 1, got {batch}, {num_kv_heads}")
    wanted = _pow2_ceil(-(-waves * num_sms // (batch * num_kv_heads)))
    by_length = _pow2_floor(max(1, max_kv_len // MIN_TOKENS_PER_SPLIT))
    return max(1, min(wanted, by_length, max_splits))


def flashinfer_page_lists(
    block_tables: torch.Tensor,  # int32 [B, max_blocks] on the device
    kv_lens: list[int],
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_indptr int32 [B+1] host, kv_indices int32 [nnz] device, last_page_len int32 [B] host)."""
    pages = [-(-n // page_size) for n in kv_lens]
    if any(p > block_tables.shape[1] for p in pages):
        raise ValueError(f"a kv_len needs {max(pages)} pages but block_tables has {block_tables.shape[1]} columns")
    counts = torch.tensor(pages, dtype=torch.int64)
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(counts, 0)
    rows = torch.repeat_interleave(torch.arange(len(pages)), counts)
    cols = torch.arange(int(indptr[-1])) - indptr[:-1].long()[rows]
    device = block_tables.device
    indices = block_tables[rows.to(device, non_blocking=True), cols.to(device, non_blocking=True)].to(torch.int32)
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    return indptr, indices, last


@dataclass
class StepBuffers:
    """One layer kind's decode metadata at fixed addresses: [max_batch, max_blocks] tables, lengths
    and [max_tokens] slots. Views `[:B]` of these are what the kernels read."""

    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    slot_mapping: torch.Tensor

    @staticmethod
    def allocate(max_batch: int, max_blocks: int, max_tokens: int, device) -> "StepBuffers":
        return StepBuffers(
            block_tables=torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device),
            kv_lens=torch.zeros(max_batch, dtype=torch.int32, device=device),
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
        )

    def fill(self, meta: KVGroupMeta, num_tokens: int) -> None:
        batch, cols = meta.block_tables.shape
        max_batch, max_blocks = self.block_tables.shape
        if batch > max_batch or cols > max_blocks or num_tokens > self.slot_mapping.numel():
            raise ValueError(
                f"step of {batch} sequences x {cols} pages, {num_tokens} tokens exceeds the backend's buffers "
                f"({max_batch} x {max_blocks}, {self.slot_mapping.numel()}); raise max_batch / max_kv_len"
            )
        # Columns past `cols` keep stale pages: the kernels never read past ceil(kv_len / page).
        self.block_tables[:batch, :cols].copy_(meta.block_tables, non_blocking=True)
        self.kv_lens[:batch].copy_(meta.kv_lens, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping, non_blocking=True)
        # Rows a larger captured graph still covers must do nothing: no length, no cache write.
        self.kv_lens[batch:].zero_()
        self.slot_mapping[num_tokens:].fill_(-1)
