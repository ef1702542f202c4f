"""Scheduling policy on its own (no model): budgets, seats, FCFS, preemption of the newest, and
progress for everybody under random load with pools far smaller than the load."""

import random

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.request import SamplingParams
from engine.scheduler import Scheduler, StepKind
from engine.sequence import Sequence, SequenceStatus


def _seq(i: int, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(f"r{i}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens), seed=0, arrival=i)


def _apply(sched: Scheduler, out) -> list[Sequence]:
    """What the engine does after a forward: cache the chunk, free window pages, append a sample."""
    done = []
    for s in out.scheduled:
        s.seq.num_computed = s.end
        sched.block_manager.release_out_of_window(s.seq)
        if s.samples:
            s.seq.output_ids.append(0)
            if len(s.seq.output_ids) >= s.seq.sampling.max_tokens:
                sched.remove(s.seq)
                s.seq.status = SequenceStatus.FINISHED
                done.append(s.seq)
    return done


def _scheduler(full: int, sliding: int, **kw) -> Scheduler:
    config = EngineConfig(block_size=4, **kw)
    return Scheduler(config, BlockManager(4, 8, full, sliding))


def test_budget_seats_and_fcfs_admission():
    sched = _scheduler(1000, 1000, max_num_seqs=3, max_num_batched_tokens=10)
    seqs = [_seq(i, n, 2) for i, n in enumerate([4, 9, 2, 3])]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    # r0 takes 4 tokens, r1 the 6 left (a chunk of its 9): budget used up, nobody overtakes r1.
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("r0", 4), ("r1", 6)]
    _apply(sched, out)
    out = sched.schedule()
    # r0 decodes (1), r1 finishes its prompt (3), r2 is admitted (2); r3 has no seat (max_num_seqs 3).
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("r0", 1), ("r1", 3), ("r2", 2)]
    assert [s.request_id for s in sched.waiting] == ["r3"]


def test_decode_and_prefill_kinds_split_the_work():
    sched = _scheduler(1000, 1000, max_num_seqs=4, max_num_batched_tokens=64)
    for i, n in enumerate([5, 7]):
        sched.add(_seq(i, n, 3))
    assert sched.schedule(StepKind.DECODE).is_empty  # nothing is decoding yet
    out = sched.schedule(StepKind.PREFILL)
    assert out.num_prefill_tokens == 12 and out.num_decode_tokens == 0
    _apply(sched, out)
    sched.add(_seq(2, 6, 3))
    out = sched.schedule(StepKind.DECODE)  # the new prompt waits; the two decodes run
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r1"] and out.num_decode_tokens == 2
    _apply(sched, out)
    out = sched.schedule(StepKind.PREFILL)
    assert [s.seq.request_id for s in out.scheduled] == ["r2"]


def test_preemption_takes_the_newest_and_requeues_it_in_arrival_order():
    # 6 full pages = 24 tokens; three sequences of 8 prompt tokens grow until the pool runs out.
    sched = _scheduler(6, 100, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [_seq(i, 8, 30) for i in range(3)]
    for s in seqs:
        sched.add(s)
    _apply(sched, sched.schedule())  # all three prefilled: 2 pages each, the pool is full
    preempted = []
    for _ in range(20):
        out = sched.schedule()
        preempted += [s.request_id for s in out.preempted]
        _apply(sched, out)
        if preempted:
            break
    assert preempted[0] == "r2"  # the newest goes first
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].num_computed == 0
    assert not seqs[2].full_pages and not seqs[2].sliding_pages
    sched.add(_seq(3, 2, 2))
    assert [s.request_id for s in sched.waiting] == ["r2", "r3"]  # preempted ahead of later arrivals


@pytest.mark.parametrize("seed", range(4))
def test_random_load_always_finishes_with_the_oldest_progressing(seed):
    rng = random.Random(seed)
    # Pools for one 64-token sequence (max_model_len) and the window; load far beyond that.
    sched = _scheduler(16, 6, max_num_seqs=5, max_num_batched_tokens=12, max_model_len=64)
    pending = [_seq(i, rng.randint(1, 40), rng.randint(1, 20)) for i in range(25)]
    finished, steps = [], 0
    while pending or sched.waiting or sched.running:
        if pending and rng.random() < 0.3:
            sched.add(pending.pop(0))
        out = sched.schedule()
        bm = sched.block_manager
        assert sum(s.num_tokens for s in out.scheduled) <= 12 and len(sched.running) <= 5
        assert bm.full.num_used == sum(len(s.full_pages) for s in sched.running)
        assert bm.sliding.num_used == sum(len(s.sliding_pages) for s in sched.running)
        unfinished = sched.running + sched.waiting
        if unfinished and out.scheduled:  # FCFS: the oldest unfinished request is in every busy step
            oldest = min(unfinished, key=lambda s: s.arrival)
            assert oldest in [s.seq for s in out.scheduled]
        finished += _apply(sched, out)
        steps += 1
        assert steps < 5000, "no progress"
    assert len(finished) == 25 and bm.full.num_used == 0 and bm.sliding.num_used == 0
