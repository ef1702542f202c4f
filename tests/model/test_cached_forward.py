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
    steps, ids = _decode_through_pages(model, prompt_len, torch.float32)
    reference = model.full_logits(ids[:-1])[prompt_len - 1:]
    assert len(steps) == reference.shape[0]
    assert (steps - reference).abs().max().item() <= 1e-5


def test_fp8_pages_equal_fp32_pages_holding_fp8_rounded_values(tmp_path, monkeypatch):
    """kv_cache_dtype fp8_e4m3: the only change is every stored K/V element rounded to e4m3 (writes, page
    reads, the sliding window's edges all as with fp32 pages). On this random tiny model that moves the
    logits by 4-37% (relative norm; bf16 pages: 0.2-0.6%), which is what an fp8 cache costs."""
    from kernels.attention import backend

    make_tiny(tmp_path, dtype="float32", vocab_size=400, sliding_window=8, seed=9)
    model = load_model(tmp_path, progress=False)
    fp8_steps, fp8_ids = _decode_through_pages(model, 13, torch.float8_e4m3fn)
    store = backend.store_rows
    monkeypatch.setattr(backend, "store_rows", lambda cache, slots, rows: store(
        cache, slots, rows.to(torch.float8_e4m3fn).float()))
    steps, ids = _decode_through_pages(model, 13, torch.float32)
    assert ids == fp8_ids and torch.equal(steps, fp8_steps)
    reference = model.full_logits(ids[:-1])[12:]
    assert ((steps - reference).norm(dim=-1) / reference.norm(dim=-1)).max() > 1e-3  # rounding did happen


def _decode_through_pages(model, prompt_len: int, kv_dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    """Prompt, then greedy decode to prompt_len + 12 tokens through shuffled pages; per step logits."""
    c = model.config
    num_pages = 16
    g = torch.Generator().manual_seed(prompt_len)
    full_pages = torch.randperm(num_pages, generator=g).tolist()  # shuffled physical pages
    sliding_pages = torch.randperm(num_pages, generator=g).tolist()
    cache = PagedKVCache.allocate([c.is_sliding(i) for i in range(c.num_hidden_layers)], num_pages, num_pages,
                                  BS, c.num_key_value_heads, c.head_dim, kv_dtype, "cpu")
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
    return torch.stack(steps), ids
