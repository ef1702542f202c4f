"""Page accounting: window-layer pages are freed as decoding proceeds; pools always balance."""

import random

import pytest

from engine.block_manager import BlockManager
from engine.page_pool import KVCacheError, cdiv
from engine.request import SamplingParams
from engine.sequence import Sequence


def _seq(rid: str = "s", prompt_len: int = 1) -> Sequence:
    return Sequence(rid, [0] * prompt_len, SamplingParams(), seed=0, arrival=0)


def _visible_ok(bm: BlockManager, seq: Sequence) -> None:
    """Every position the next query can see is on a live page, and no dead page is held."""
    need_from = bm.first_visible_position(seq.num_computed)
    assert seq.sliding_first * bm.block_size <= need_from
    assert seq.sliding_first == need_from // bm.block_size or not seq.sliding_pages


def _decode(bm: BlockManager, seq: Sequence, tokens: int, chunk: int = 1) -> int:
    """Advance `seq` by `tokens` positions in chunks; returns the peak sliding pages held."""
    peak = 0
    done = 0
    while done < tokens:
        n = min(chunk, tokens - done)
        bm.allocate(seq, seq.num_computed + n)
        peak = max(peak, len(seq.sliding_pages))
        seq.num_computed += n
        done += n
        bm.release_out_of_window(seq)
        _visible_ok(bm, seq)
        assert len(seq.full_pages) == cdiv(seq.num_computed, bm.block_size)
    return peak


@pytest.mark.parametrize("window,block", [(8, 4), (7, 4), (128, 16), (5, 1), (3, 8)])
def test_sliding_pages_bounded_while_decoding(window, block):
    bm = BlockManager(block, window, num_full_pages=1000, num_sliding_pages=1000)
    seq = _seq()
    peak = _decode(bm, seq, 300)
    # At most the window's pages (it can straddle one page edge) while full pages keep growing.
    assert peak <= bm.sliding_pages_per_decode() == cdiv(window - 1, block) + 1
    assert bm.sliding.num_used == len(seq.sliding_pages) <= peak
    assert bm.full.num_used == cdiv(300, block)
    bm.free(seq)
    assert bm.full.num_used == 0 and bm.sliding.num_used == 0


@pytest.mark.parametrize("chunk", [1, 5, 19, 64])
def test_prefill_chunk_holds_window_plus_chunk(chunk):
    window, block = 8, 4
    bm = BlockManager(block, window, 1000, 1000)
    seq = _seq()
    peak = _decode(bm, seq, 200, chunk=chunk)
    assert peak <= cdiv(window - 1 + chunk, block) + 1


def test_kv_saving_32k_sequence_gpt_oss_shape():
    """gpt-oss: window 128, pages of 16. Decoding to 32k costs full pages + at most 9 sliding pages,
    against 2 x 2048 pages when both kinds keep every page."""
    block, window, length = 16, 128, 32768
    bm = BlockManager(block, window, num_full_pages=length // block, num_sliding_pages=64)
    seq = _seq(prompt_len=length)
    peak = _decode(bm, seq, length, chunk=1)
    naive = 2 * cdiv(length, block)
    windowed = bm.full.num_used + peak
    assert peak == bm.sliding_pages_per_decode() == 9
    assert windowed / naive < 0.51  # about half: the sliding half of the layers costs ~nothing


def test_max_new_tokens_matches_can_hold():
    rng = random.Random(0)
    bm = BlockManager(4, 8, num_full_pages=10, num_sliding_pages=5)
    seq = _seq()
    for _ in range(40):
        limit = rng.randint(1, 30)
        n = bm.max_new_tokens(seq, limit)
        assert n <= limit
        if n:
            assert bm.can_hold(seq, seq.num_computed + n)
        if n < limit:
            assert not bm.can_hold(seq, seq.num_computed + n + 1)
        if n == 0:
            break
        bm.allocate(seq, seq.num_computed + n)
        seq.num_computed += n
        bm.release_out_of_window(seq)
    assert bm.full.num_free == 0  # ran until the full pool was exhausted


def test_errors_and_release():
    bm = BlockManager(4, 8, num_full_pages=2, num_sliding_pages=3)
    seq = _seq()
    with pytest.raises(KVCacheError, match="not enough free pages"):
        bm.allocate(seq, 9)  # 3 full pages needed, 2 exist
    bm.allocate(seq, 8)
    assert bm.full.num_free == 0
    bm.free(seq)
    with pytest.raises(KVCacheError, match="double free"):
        bm.full.release([0])
    assert bm.usage() == {"full_pages_used": 0, "full_pages_free": 2, "full_pages_total": 2,
                          "sliding_pages_used": 0, "sliding_pages_free": 3, "sliding_pages_total": 3}


def test_import_starts_sliding_table_at_window():
    bm = BlockManager(4, 8, 100, 100)
    seq = _seq(prompt_len=30)
    bm.start_sliding_at(seq, bm.first_visible_position(29))  # 29 cached tokens -> keys 22..28 visible
    bm.allocate(seq, 30)
    assert seq.sliding_first == 22 // 4
    assert len(seq.sliding_pages) == cdiv(30, 4) - 22 // 4
    assert len(seq.full_pages) == cdiv(30, 4)
    with pytest.raises(KVCacheError, match="already holds pages"):
        bm.start_sliding_at(seq, 0)


def test_allocate_next_tokens_equals_one_by_one_and_is_all_or_none():
    rng = random.Random(3)
    batched, single = BlockManager(4, 8, 200, 200), BlockManager(4, 8, 200, 200)
    seqs_b, seqs_s = [_seq(f"b{i}") for i in range(9)], [_seq(f"s{i}") for i in range(9)]
    for sb, ss in zip(seqs_b, seqs_s):  # awkward starting points: page edges and mid-page
        n, chunk = rng.randrange(1, 30), rng.choice([1, 5])
        for bm, s in ((batched, sb), (single, ss)):
            _decode(bm, s, n, chunk=chunk)
    for _ in range(25):
        assert batched.allocate_next_tokens(seqs_b)
        for s in seqs_s:
            single.allocate(s, s.num_computed + 1)
        for sb, ss in zip(seqs_b, seqs_s):  # the same page ids, not only as many (one allocate per pool)
            assert (sb.full_pages.array().tolist(), sb.sliding_first, list(sb.sliding_pages)) == \
                   (ss.full_pages.array().tolist(), ss.sliding_first, list(ss.sliding_pages))
        for bm, seqs in ((batched, seqs_b), (single, seqs_s)):
            for s in seqs:
                s.num_computed += 1
                bm.release_out_of_window(s)
        assert batched.usage() == single.usage()
    # Too few free pages for everyone: nothing is allocated.
    tight = BlockManager(4, 8, 3, 200)
    seqs = [_seq(f"t{i}") for i in range(4)]
    assert not tight.allocate_next_tokens(seqs)  # 4 sequences need a first full page each, 3 are free
    assert tight.full.num_free == 3 and all(len(s.full_pages) == 0 for s in seqs)
    assert tight.allocate_next_tokens(seqs[:3]) and tight.full.num_free == 0


@pytest.mark.parametrize("caching,has_sliding", [(True, True), (False, True), (True, False)])
def test_after_forward_equals_register_then_release_one_by_one(caching, has_sliding):
    """BlockManager.after_forward (the engine's call after each step, early outs inlined) leaves the pages, the
    window's releases and the prefix cache's names as register_blocks + release_out_of_window per sequence do, over
    prefill chunks and decode steps that cross page edges and prompt ends at awkward places."""
    rng = random.Random(11)
    window, block = 7, 4
    managers = [BlockManager(block, window, 400, 400, has_sliding=has_sliding, prefix_caching=caching)
                for _ in range(2)]
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(8)]
    prompts[1] = list(prompts[0])  # a shared prompt: the second finds the first one's names
    seqs = [[Sequence(f"s{i}", list(p), SamplingParams(), seed=0, arrival=i) for i, p in enumerate(prompts)]
            for _ in managers]
    for step in range(60):
        for bm, group in zip(managers, seqs):
            for seq in group:
                left = len(seq.prompt_ids) - seq.num_computed
                n = min(left, random.Random(step * 100 + int(seq.request_id[1:])).choice([1, 3, 9])) if left > 0 else 1
                bm.allocate(seq, seq.num_computed + n)
                seq.num_computed += n
        batched, single = managers
        batched.after_forward(seqs[0])
        for seq in seqs[1]:
            single.register_blocks(seq)
            single.release_out_of_window(seq)
        for a, b in zip(*seqs):
            assert (a.full_pages.array().tolist(), list(a.sliding_pages), a.sliding_first, a.num_registered) == \
                   (b.full_pages.array().tolist(), list(b.sliding_pages), b.sliding_first, b.num_registered)
        assert batched.usage() == single.usage()
    assert any(s.num_registered for s in seqs[0]) == caching
    assert not has_sliding or all(s.sliding_first > 0 for s in seqs[0])  # the window moved on for every sequence
