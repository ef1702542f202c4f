"""The runner's cached forward (paged K/V, window pages freed) equals the model's full recompute."""

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.request import SamplingParams
from engine.runner import ModelRunner, plan_pool_sizes
from engine.step_arrays import build_step_inputs
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from tests.engine.engine_testlib import BLOCK, WINDOW, random_prompt


def _runner(model, pages: int = 64):
    runner = ModelRunner(model, BLOCK)
    runner.allocate_kv_cache(pages, pages)
    # Poison every page: any read of a slot the step did not write (or of a freed page) shows up as NaN.
    for t in (*runner.kv_cache.k, *runner.kv_cache.v):
        t.fill_(float("nan"))
    return runner, BlockManager(BLOCK, WINDOW, pages, pages)


def _step(runner, bm, work: list[tuple[Sequence, int]]) -> torch.Tensor:
    scheduled = []
    for seq, n in work:
        bm.allocate(seq, seq.num_computed + n)
        scheduled.append(ScheduledSeq(seq, seq.num_computed, n, is_prefill=n > 1))
    logits = runner.execute(runner.prepare(scheduled))
    for s in scheduled:
        s.seq.num_computed = s.end
        bm.release_out_of_window(s.seq)
    return logits


@pytest.mark.parametrize("prompt_len,chunk", [(3, 64), (5, 2), (8, 64), (13, 64), (21, 4), (30, 7)])
def test_cached_decode_matches_full_logits(model, prompt_len, chunk):
    """Prefill (in chunks of `chunk`), then 14 tokens one by one; window 8, pages of 4."""
    runner, bm = _runner(model)
    seq = Sequence("a", random_prompt(prompt_len, prompt_len), SamplingParams(), 0, 0)
    got = []
    while seq.num_remaining:
        logits = _step(runner, bm, [(seq, min(chunk, seq.num_remaining))])
        if seq.num_remaining == 0:  # the chunk reached the last token: the runner returned its logits
            got.append(logits[0])
            seq.output_ids.append(int(logits[0].argmax()))
        if len(seq.output_ids) == 14:
            break
        assert len(seq.sliding_pages) <= -(-(WINDOW - 1 + chunk) // BLOCK) + 1
    ids = seq.prompt_ids + seq.output_ids
    reference = model.full_logits(ids[:-1])[prompt_len - 1:]
    assert torch.stack(got).shape == reference.shape
    assert (torch.stack(got) - reference).abs().max().item() <= 1e-5


def test_mixed_batch_of_prefills_and_decodes(model):
    """Several sequences at different stages in one forward: each row equals its own recompute."""
    runner, bm = _runner(model, pages=128)
    seqs = [Sequence(f"s{i}", random_prompt(n, 100 + i), SamplingParams(), 0, i) for i, n in enumerate([1, 9, 17, 4])]
    _step(runner, bm, [(seqs[1], 9), (seqs[2], 10)])  # s1 prefilled, s2 half-way
    for s in (seqs[1],):
        s.output_ids.append(5)
    logits = _step(runner, bm, [(seqs[0], 1), (seqs[1], 1), (seqs[2], 7), (seqs[3], 4)])
    assert logits.shape[0] == 4  # every sequence reached its last known token
    for row, seq in enumerate(seqs):
        ref = model.full_logits(seq.prompt_ids + seq.output_ids)[-1]
        assert (logits[row] - ref).abs().max().item() <= 1e-5


def test_step_inputs_layout(model):
    runner, bm = _runner(model)
    seq = Sequence("a", random_prompt(23, 1), SamplingParams(), 0, 0)
    _step(runner, bm, [(seq, 23)])  # positions 0..22 cached; sliding keeps keys 16..22 -> pages 4, 5
    seq.output_ids.append(7)
    bm.allocate(seq, 24)
    inputs = build_step_inputs([ScheduledSeq(seq, 23, 1, False)], BLOCK, "cpu")
    a = inputs.attention
    assert a.is_decode and inputs.input_ids.tolist() == [7] and inputs.positions.tolist() == [23]
    assert a.full.kv_lens_cpu == [24] and a.full.block_tables.shape == (1, 6)
    assert seq.sliding_first == 4 and a.sliding.kv_lens_cpu == [24 - 16]
    assert a.sliding.block_tables[0].tolist() == list(seq.sliding_pages)
    assert a.sliding.slot_mapping.tolist() == [seq.sliding_pages[1] * BLOCK + 3]
    assert a.full.slot_mapping.tolist() == [seq.full_pages[5] * BLOCK + 3]


def test_pool_sizes_from_a_byte_budget():
    config = EngineConfig(block_size=16, max_num_seqs=64, max_num_batched_tokens=2048)
    full_bytes = sliding_bytes = 18 * 2 * 16 * 8 * 64 * 2  # gpt-oss-120b: 18 layers of each kind, bf16
    full, sliding = plan_pool_sizes(config, 40 * 2**30, full_bytes, sliding_bytes, 128)
    assert sliding == 64 * (8 + 2) + 2048 // 16
    assert full == (40 * 2**30 - sliding * sliding_bytes) // full_bytes
    assert plan_pool_sizes(config, 2**20, 0, sliding_bytes, 128) == (0, 2**20 // sliding_bytes)
