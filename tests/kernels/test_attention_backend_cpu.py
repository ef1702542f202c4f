"""The GPU backend's host-side planning (kernels/attention/gpu_plan.py), on CPU tensors."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.attention.gpu_plan import (
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    StepBuffers,
    decode_num_splits,
    flashinfer_page_lists,
)
from kernels.attention.metadata import KVGroupMeta
from kernels.attention.reference import sliding_tile_lists


@pytest.mark.parametrize("batch", [1, 3, 8, 37, 64, 256])
@pytest.mark.parametrize("max_kv_len", [1, 127, 1000, 8192, 33000, 131072])
def test_decode_num_splits_is_bounded_power_of_two(batch, max_kv_len):
    splits = decode_num_splits(batch, max_kv_len, num_kv_heads=8, num_sms=132)
    assert splits & (splits - 1) == 0 and 1 <= splits <= MAX_SPLITS
    # never so many splits that one holds fewer than MIN_TOKENS_PER_SPLIT tokens (except the 1-split floor)
    assert splits == 1 or max_kv_len // splits >= MIN_TOKENS_PER_SPLIT
    # enough programs to fill the GPU when the sequences are long enough
    if max_kv_len >= MAX_SPLITS * MIN_TOKENS_PER_SPLIT:
        assert batch * 8 * splits >= 4 * 132 or splits == MAX_SPLITS


def test_decode_num_splits_shrinks_as_the_batch_grows():
    counts = [decode_num_splits(b, 131072, 8, 132) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] == MAX_SPLITS and counts[-1] == 1
    with pytest.raises(ValueError, match="batch >= 1"):
        decode_num_splits(0, 10, 8, 132)


def _random_tables(rng: random.Random, lens: list[int], page: int, extra_cols: int):
    pages = [-(-n // page) for n in lens]
    pool = list(range(sum(pages) + 7))
    rng.shuffle(pool)
    table = torch.zeros(len(lens), max(pages) + extra_cols, dtype=torch.int32)
    at = 0
    for b, p in enumerate(pages):
        table[b, :p] = torch.tensor(pool[at : at + p], dtype=torch.int32)
        at += p
    return table, pages


@pytest.mark.parametrize("page", [1, 16, 64])
def test_flashinfer_page_lists_match_the_tables(page):
    rng = random.Random(page)
    lens = [1, 127, 128, 129, 1000, 16, 17]
    table, pages = _random_tables(rng, lens, page, extra_cols=3)
    indptr, indices, last = flashinfer_page_lists(table, lens, page)
    assert indptr.tolist() == [sum(pages[:i]) for i in range(len(lens) + 1)]
    for b, n in enumerate(lens):
        assert indices[indptr[b] : indptr[b + 1]].tolist() == table[b, : pages[b]].tolist()
        assert 1 <= last[b] <= page and (pages[b] - 1) * page + int(last[b]) == n
    assert indices.dtype == torch.int32 and last.dtype == torch.int32


def test_flashinfer_page_lists_reject_a_too_narrow_table():
    with pytest.raises(ValueError, match="columns"):
        flashinfer_page_lists(torch.zeros(1, 2, dtype=torch.int32), [33], 16)


def test_step_buffers_fill_in_place_and_blank_the_rest():
    bufs = StepBuffers.allocate(max_batch=8, max_blocks=10, max_tokens=8, device="cpu")
    addresses = (bufs.block_tables.data_ptr(), bufs.kv_lens.data_ptr(), bufs.slot_mapping.data_ptr())
    table = torch.randint(0, 100, (5, 4), dtype=torch.int32)
    meta = KVGroupMeta(block_tables=table, kv_lens=torch.tensor([3, 1, 64, 17, 9], dtype=torch.int32),
                       slot_mapping=torch.tensor([2, 17, 1023, 400, 8]), kv_lens_cpu=[3, 1, 64, 17, 9])
    bufs.fill(meta, 5)
    assert (bufs.block_tables.data_ptr(), bufs.kv_lens.data_ptr(), bufs.slot_mapping.data_ptr()) == addresses
    assert torch.equal(bufs.block_tables[:5, :4], table)
    assert bufs.kv_lens.tolist() == [3, 1, 64, 17, 9, 0, 0, 0]
    assert bufs.slot_mapping.tolist() == [2, 17, 1023, 400, 8, -1, -1, -1]
    # a smaller next step (graph replay at the captured size): stale rows become no-ops
    small = KVGroupMeta(block_tables=table[:2, :2], kv_lens=torch.tensor([5, 6], dtype=torch.int32),
                        slot_mapping=torch.tensor([4, 5]), kv_lens_cpu=[5, 6])
    bufs.fill(small, 2)
    assert bufs.kv_lens.tolist() == [5, 6] + [0] * 6
    assert bufs.slot_mapping.tolist() == [4, 5] + [-1] * 6


def test_step_buffers_refuse_a_step_larger_than_allocated():
    bufs = StepBuffers.allocate(max_batch=2, max_blocks=3, max_tokens=2, device="cpu")
    meta = KVGroupMeta(block_tables=torch.zeros(3, 1, dtype=torch.int32), kv_lens=torch.ones(3, dtype=torch.int32),
                       slot_mapping=torch.zeros(3, dtype=torch.int64), kv_lens_cpu=[1, 1, 1])
    with pytest.raises(ValueError, match="max_batch"):
        bufs.fill(meta, 3)


def test_attention_triton_kernels_under_the_interpreter():
    """The sliding-window prefill kernel against reference.sink_attention, the dense-prefill rescale kernel against
    its formula (attention_interpreter_cases.py)."""
    from tests.kernels.interpreter import run_cases

    run_cases("attention_interpreter_cases.py")


@pytest.mark.parametrize("block_m", [1, 2, 16])
def test_plan_tiles_matches_the_loop_and_aligns_every_list(block_m):
    pytest.importorskip("triton")
    from kernels.attention.sliding_prefill_triton import plan_tiles

    rng = random.Random(block_m)
    cases = [[], [1], [1024], [0, 5, 0], [rng.randrange(0, 300) for _ in range(rng.randrange(1, 40))], [1] * 257]
    for lens in cases:
        for q_starts in (None, [rng.randrange(0, 10_000) for _ in lens]):
            tables = torch.zeros(len(lens), 3, dtype=torch.int32)
            kv_lens = torch.tensor(lens, dtype=torch.int32)
            tiles = plan_tiles(lens, tables, kv_lens, block_m, q_starts)
            seq, q0, starts, q_len = sliding_tile_lists(lens, block_m, q_starts)
            got = [tiles.tile_seq, tiles.tile_q0, tiles.q_start, tiles.q_len]
            assert [g.tolist() for g in got] == [seq, q0, starts, q_len], (lens, q_starts)
            assert tiles.num_tiles == len(seq) and all(g.dtype == torch.int32 for g in got)
            base = got[0].untyped_storage().data_ptr()
            assert all(g.untyped_storage().data_ptr() == base for g in got), "one packed copy"
            assert all(g.storage_offset() % 4 == 0 for g in got), "each list on a 16-byte boundary"
            assert tiles.block_tables is tables and tiles.kv_lens is kv_lens
