"""The messages rank 0 sends the other ranks each step (engine/distributed/wire.py): a step's arrays and
slot maps round-trip exactly, and a decode step sent as a delta of the previous one, or a step whose batch changed
sent as the rows it carries from the previous one, rebuilds exactly."""

from __future__ import annotations

import numpy as np
import pytest

from engine.distributed.wire import (apply_step_carry, apply_step_delta, pack_slots, pack_step, pack_step_carry,
                                     pack_step_delta, unpack_slots, unpack_step)
from engine.step_arrays import StepArrays


@pytest.mark.parametrize("batch", [[1], [3, 1, 17], [1] * 7, [29, 2]])
def test_step_messages_round_trip(batch):
    g = np.random.default_rng(len(batch))
    b, t = len(batch), sum(batch)
    n = int(g.integers(0, b + 1))
    ints = lambda shape, dtype: g.integers(0, 1 << 20, shape).astype(dtype)  # noqa: E731
    a = StepArrays(ints(t, np.int64), ints(t, np.int64), np.concatenate([[0], np.cumsum(batch)]).astype(np.int32),
                   ints((b, 5), np.int32), ints(b, np.int32), ints(t, np.int64), ints((b, 2), np.int32),
                   ints(b, np.int32), ints(t, np.int64), ints(n, np.int64),
                   sorted(g.choice(b, n, replace=False).tolist()))
    back = unpack_step(pack_step(a))
    for name in StepArrays.__dataclass_fields__:
        got, want = getattr(back, name), getattr(a, name)
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and got.shape == want.shape and (got == want).all(), name
        else:
            assert got == want, name
    inputs = back.to_inputs("cpu")
    assert inputs.attention.query_lens_cpu == batch and inputs.attention.is_decode == all(x == 1 for x in batch)
    for slots in ({False: ints(7, np.int64)}, {True: ints(3, np.int64)},
                  {False: ints(0, np.int64), True: ints(5, np.int64)}):
        back = unpack_slots(pack_slots(slots))
        assert back.keys() == slots.keys() and all((back[k] == slots[k]).all() for k in slots)


def test_step_delta_round_trip_and_mismatch():
    """A decode step sent as a delta of the previous one rebuilds exactly on the receiving side, with
    table widths growing and shrinking and some rows replaced; a delta against another base is refused."""
    g = np.random.default_rng(5)
    b = 6
    ints = lambda shape, dtype: g.integers(0, 1 << 20, shape).astype(dtype)  # noqa: E731
    prev = StepArrays(ints(b, np.int64), ints(b, np.int64), np.arange(b + 1, dtype=np.int32), ints((b, 4), np.int32),
                      ints(b, np.int32), ints(b, np.int64), ints((b, 3), np.int32), ints(b, np.int32),
                      ints(b, np.int64), np.arange(b, dtype=np.int64), list(range(b)))
    for pf, ps in ((5, 2), (4, 3), (3, 4)):
        full_rows, sliding_rows = np.array([1, 4]), np.array([0, 2, 5])
        full = np.zeros((b, pf), dtype=np.int32)
        full[:, : min(pf, 4)] = prev.full_tables[:, : min(pf, 4)]
        full[full_rows] = ints((2, pf), np.int32)
        sliding = np.zeros((b, ps), dtype=np.int32)
        sliding[:, : min(ps, 3)] = prev.sliding_tables[:, : min(ps, 3)]
        sliding[sliding_rows] = ints((3, ps), np.int32)
        cur = StepArrays(ints(b, np.int64), prev.positions + 1, prev.query_start_loc, full, prev.full_lens + 1,
                         ints(b, np.int64), sliding, ints(b, np.int32), ints(b, np.int64), prev.logits_indices,
                         prev.sample_rows)
        back = apply_step_delta(prev, 7, pack_step_delta(cur, full_rows, sliding_rows, 7))
        for name in StepArrays.__dataclass_fields__:
            got, want = getattr(back, name), getattr(cur, name)
            if isinstance(want, np.ndarray):
                assert got.dtype == want.dtype and got.shape == want.shape and (got == want).all(), (name, pf, ps)
            else:
                assert got == want, name
    with pytest.raises(ValueError, match="out of step"):
        apply_step_delta(prev, 6, pack_step_delta(cur, full_rows, sliding_rows, 7))


def _assert_same(got: StepArrays, want: StepArrays, label) -> None:
    for name in StepArrays.__dataclass_fields__:
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), (name, label)
        else:
            assert a == b, (name, label)


@pytest.mark.parametrize("rows_before,rows_after", [(6, 9), (9, 4), (30, 30), (5, 1)])
def test_step_carry_round_trip_and_mismatch(rows_before, rows_after):
    """A step whose batch changed, sent as the rows it carries from the previous step (any of them, in any order;
    the others new) and the table rows built anew, rebuilds exactly, with table widths growing and shrinking and
    prefill chunks among the rows; a carry against another base, or naming a row the base lacks, is refused."""
    g = np.random.default_rng(rows_before * 100 + rows_after)
    ints = lambda shape, dtype: g.integers(0, 1 << 20, shape).astype(dtype)  # noqa: E731

    def step(b: int, pf: int, ps: int) -> StepArrays:
        lens = g.integers(1, 6, b) * (g.random(b) < 0.3) + 1  # mostly one token, some chunks
        t, n = int(lens.sum()), int(g.integers(0, b + 1))
        return StepArrays(ints(t, np.int64), ints(t, np.int64), np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
                          ints((b, pf), np.int32), ints(b, np.int32), ints(t, np.int64), ints((b, ps), np.int32),
                          ints(b, np.int32), ints(t, np.int64), ints(n, np.int64),
                          sorted(g.choice(b, n, replace=False).tolist()))

    prev = step(rows_before, 4, 3)
    for pf, ps in ((6, 2), (4, 3), (2, 5)):
        cur = step(rows_after, pf, ps)
        source = np.full(rows_after, -1, dtype=np.int64)
        kept = g.choice(rows_before, min(rows_before, rows_after), replace=False)
        at = g.choice(rows_after, len(kept), replace=False)
        source[at] = kept
        source[at[: len(at) // 3]] = -1  # some rows new even where an old row could go
        carried = np.flatnonzero(source >= 0)
        built = np.flatnonzero((source < 0) | (g.random(rows_after) < 0.3))
        full, sliding = np.zeros((rows_after, pf), np.int32), np.zeros((rows_after, ps), np.int32)
        full[carried, : min(pf, 4)] = prev.full_tables[source[carried], : min(pf, 4)]
        sliding[carried, : min(ps, 3)] = prev.sliding_tables[source[carried], : min(ps, 3)]
        full[built], sliding[built] = cur.full_tables[built], cur.sliding_tables[built]
        cur.full_tables, cur.sliding_tables = full, sliding
        message = pack_step_carry(cur, source, built, built, 7)
        _assert_same(apply_step_carry(prev, 7, message), cur, (pf, ps))
    with pytest.raises(ValueError, match="out of step"):
        apply_step_carry(prev, 6, message)
    short = step(max(1, int(source.max())), 4, 3) if source.max() >= 1 else None
    if short is not None:
        with pytest.raises(ValueError, match="out of step"):
            apply_step_carry(short, 7, message)
