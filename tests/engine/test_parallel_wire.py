"""The messages rank 0 sends the other ranks each step (engine/distributed/wire.py): a step's arrays and
slot maps round-trip exactly, and a decode step sent as a delta of the previous one rebuilds exactly."""

from __future__ import annotations

import numpy as np
import pytest

from engine.distributed.wire import apply_step_delta, pack_slots, pack_step, pack_step_delta, unpack_slots, unpack_step
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
