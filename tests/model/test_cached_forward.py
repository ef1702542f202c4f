"""Prompt, then token-by-token decode through the paged KV cache == full recompute."""

import pytest
import torch

from kernels.attention import AttentionBatch, KVGroupMeta, PagedKVCache
from model.loader import load_model
from model.tiny import make_tiny

BS = 4  # page size: small so that windows span several pages


def _group(pages: list[int], first_page: int, total: int, new: int) -> KVGroupMeta:
    """Metadata for one sequence whose visible pages are pages[first_page:], `total` tokens so far."""
    table = pages[first_page: -(-total // BS)]
    kv_len = total - first_page * BS
    slots = [pages[p // BS] * BS + p % BS for p in range(total - new, total)]
    return KVGroupMeta(
        block_tables=torch.tensor([table], dtype=torch.int32),
        kv_lens=torch.tensor([kv_len], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        kv_lens_cpu=[kv_len],
    )


@pytest.mark.parametrize("prompt_len", [3, 13])  # shorter and longer than the window (8)
def test_decode_through_pages_matches_recompute(tmp_path, prompt_len):
    make_tiny(tmp_path, dtype="float32", vocab_size=400, sliding_window=8, seed=9)
    model = load_model(tmp_path, progress=False)
    c = model.config
    num_pages = 16
    g = torch.Generator().manual_seed(prompt_len)
    full_pages = torch.randperm(num_pages, generator=g).tolist()  # shuffled physical pages
    sliding_pages = torch.randperm(num_pages, generator=g).tolist()
    cache = PagedKVCache.allocate([c.is_sliding(i) for i in range(c.num_hidden_layers)], num_pages, num_pages,
                                  BS, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
    model.backend.bind_cache(cache)

    ids = torch.randint(0, c.vocab_size, (prompt_len,), generator=g).tolist()
    steps, chunk, done = [], ids, 0
    while len(ids) < prompt_len + 12:
        total = done + len(chunk)
        first_live = max(0, (done - (c.sliding_window - 1)) // BS)
        batch = AttentionBatch(
            query_start_loc=torch.tensor([0, len(chunk)], dtype=torch.int32), query_lens_cpu=[len(chunk)],
            full=_group(full_pages, 0, total, len(chunk)),
            sliding=_group(sliding_pages, first_live, total, len(chunk)),
            is_decode=len(chunk) == 1)
        hidden = model(torch.tensor(chunk), torch.arange(done, total), batch)
        logits = model.compute_logits(hidden[-1:])[0]
        steps.append(logits)
        nxt = int(logits.argmax())
        ids.append(nxt)
        done, chunk = total, [nxt]
        if first_live:  # pages before the window really are unused: poison them
            for layer in range(c.num_hidden_layers):
                if c.is_sliding(layer):
                    cache.k[layer][sliding_pages[:first_live]] = float("nan")

    reference = model.full_logits(ids[:-1])[prompt_len - 1:]
    assert len(steps) == reference.shape[0]
    assert (torch.stack(steps) - reference).abs().max().item() <= 1e-5
