"""StepArrayBuilder (the fast paths of the step metadata) against build_step_arrays, its definition:
every step of engines that cross page edges, free sliding pages, admit and finish sequences mid-run,
prefill in chunks beside decodes and preempt under a tiny pool must get identical arrays."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.step_arrays import StepArrays, build_step_arrays
from tests.engine.engine_testlib import BLOCK, greedy, random_prompt, request, run_to_end


def assert_same(fast: StepArrays, slow: StepArrays) -> None:
    for f in dataclasses.fields(StepArrays):
        a, b = getattr(fast, f.name), getattr(slow, f.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f.name
        else:
            assert a == b, f.name


def checked(engine) -> dict:
    """Make `engine` compare every step's arrays with build_step_arrays; count fast-path steps. The fast
    path's batch threshold (a speed trade-off, MIN_BATCH) is lowered so that small tests exercise it."""
    builder, counts = engine.runner.step_arrays, {"fast": 0, "carry": 0, "steps": 0}
    builder.MIN_BATCH = 8
    build, advance, carry = builder.build, builder._advance, builder._carry

    def counting_advance(*args):
        counts["fast"] += 1
        return advance(*args)

    def counting_carry(*args):
        counts["carry"] += 1
        return carry(*args)

    def checking_build(scheduled):
        fast = build(scheduled)
        assert_same(fast, build_step_arrays(scheduled, BLOCK))
        counts["steps"] += 1
        return fast

    builder._advance, builder._carry, builder.build = counting_advance, counting_carry, checking_build
    return counts


SPECS = [(3, 30), (9, 25), (1, 20), (17, 12), (6, 28), (2, 33), (11, 21), (5, 26), (8, 19), (4, 31)]


@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_fast_path_arrays_equal_build_step_arrays(make_engine, pool):
    # 10 sequences (the fast path needs a batch of >= MIN_BATCH, set to 8 by `checked`); "tight": the
    # pool cannot hold them all to the end, so sequences are preempted and come back.
    engine = make_engine(max_num_seqs=12, max_model_len=48) if pool == "roomy" else make_engine(
        max_num_seqs=12, max_model_len=48, num_full_pages=56, num_sliding_pages=36, max_num_batched_tokens=32)
    counts = checked(engine)
    # Prompts shorter and longer than the window (8) and the page (4); outputs long enough to cross
    # several page edges and free sliding pages while decoding.
    for i, (n, m) in enumerate(SPECS):
        engine.add_request(request(f"r{i}", random_prompt(n, i), greedy(m)))
    for _ in range(6):  # a few steps in, a new sequence joins the batch
        engine.step()
    engine.add_request(request("late", random_prompt(5, 99), greedy(15)))
    out = run_to_end(engine)
    assert set(out) >= {"r0", "late"}
    assert counts["fast"] > counts["steps"] // 4, counts  # the fast path did a good share of the steps
    if pool == "tight":
        assert engine.metrics.snapshot()["preemptions_total"] > 0


@pytest.mark.parametrize("pool,lookahead", [("roomy", False), ("tight", False), ("roomy", True), ("tight", True)])
def test_steady_traffic_arrays_equal_build_step_arrays(make_engine, pool, lookahead):
    """Traffic as a server sees it: a request arrives every step or two with a random prompt (some share a
    prefix, so the prefix cache hands out pages mid-run) and a random output length, so nearly every step
    has a sequence joining or finishing, often a prefill chunk beside the decodes (4-token chunks at the
    tightest budget), and in the tight pool preemptions; with the lookahead, steps are built before the
    previous step's tokens are known. Every step's arrays equal build_step_arrays', and `_carry` builds many
    of them."""
    import random

    rng = random.Random()
    kw = dict(max_num_seqs=16, max_model_len=64, max_num_batched_tokens=rng.choice([20, 24, 40]),
              async_decode=lookahead)
    if pool == "tight":
        kw.update(num_full_pages=60, num_sliding_pages=44)
    engine = make_engine(**kw)
    counts = checked(engine)
    shared = random_prompt(9, 7)
    out, added = {}, 0
    for step in range(400):
        if added < 60 and rng.random() < 0.6:
            prompt = (shared if rng.random() < 0.3 else []) + random_prompt(rng.randint(1, 23), rng.randint(0, 10**6))
            engine.add_request(request(f"q{added}", prompt, greedy(rng.randint(1, 30))))
            added += 1
        elif added >= 60 and not engine.has_unfinished():
            break
        for d in engine.step():
            out[d.request_id] = d.finish_reason
    assert len(out) == 60 and all(out.values()), out
    assert counts["carry"] >= 20, counts  # (~40-80 of ~110-150 steps; the others have < MIN_BATCH rows)
    if pool == "tight":
        assert engine.metrics.snapshot()["preemptions_total"] > 0


def test_outputs_do_not_depend_on_the_fast_path(make_engine):
    reqs = [request(f"r{i}", random_prompt(n, i), greedy(m)) for i, (n, m) in enumerate(SPECS)]
    with_fast, without = make_engine(max_num_seqs=12, max_model_len=48), make_engine(max_num_seqs=12, max_model_len=48)
    with_fast.runner.step_arrays.MIN_BATCH = 8
    without.runner.step_arrays._continues = lambda *_: False
    without.runner.step_arrays.carry = False
    for e in (with_fast, without):
        for r in reqs:
            e.add_request(r)
    assert {k: v["ids"] for k, v in run_to_end(with_fast).items()} == \
           {k: v["ids"] for k, v in run_to_end(without).items()}


@pytest.mark.parametrize("pool,traffic", [("roomy", "batch"), ("tight", "batch"), ("roomy", "steady"),
                                          ("tight", "steady")])
def test_scheduler_decode_fast_path_schedules_what_the_loop_would(make_engine, pool, traffic):
    """Two engines in lockstep, one with the scheduler's all-decode fast path and its decode runs (a prefill chunk
    among the running sequences) switched off: the same sequences, positions, preemptions and pages at every step,
    and the same outputs. "steady": a request arrives every other step (random lengths), so chunks ride along."""
    import random

    kw = dict(max_num_seqs=12, max_model_len=48)
    if pool == "tight":
        kw.update(num_full_pages=56, num_sliding_pages=36, max_num_batched_tokens=32)
    if traffic == "steady":
        kw.update(max_num_batched_tokens=20)
        if pool == "tight":  # sequences outgrow the pool: preempted ones recompute in chunks beside decode runs
            kw.update(num_full_pages=30, num_sliding_pages=24, max_num_batched_tokens=12)
    fast, loop = make_engine(**kw), make_engine(**kw)
    loop.scheduler._all_decode = lambda kind: False
    loop.scheduler.decode_runs = False
    taken = {"fast": 0, "runs": 0}
    all_decode, decode_run = fast.scheduler._all_decode, fast.scheduler._decode_run

    def counting(kind):
        result = all_decode(kind)
        taken["fast"] += result
        return result

    def counting_runs(*args):
        result = decode_run(*args)
        taken["runs"] += result > 0
        return result

    fast.scheduler._all_decode, fast.scheduler._decode_run = counting, counting_runs
    arrivals = {}
    if traffic == "batch":
        specs = SPECS
    else:
        rng = random.Random()
        specs = [(rng.randint(1, 30), rng.randint(4, 20) if pool == "roomy" else rng.randint(12, 26)) for _ in range(30)]
        arrivals = {2 * k: k for k in range(len(specs))}  # step -> the spec that arrives then
    for e in (fast, loop):
        for i, (n, m) in enumerate(specs if traffic == "batch" else []):
            e.add_request(request(f"r{i}", random_prompt(n, i), greedy(m)))

    def state(engine, out):
        return ([(s.seq.request_id, s.start, s.num_tokens, s.is_prefill) for s in out.scheduled],
                [s.request_id for s in out.preempted],
                sorted((s.request_id, len(s.full_pages), s.sliding_first, len(s.sliding_pages))
                       for s in engine.scheduler.running))

    outputs = {"fast": {}, "loop": {}}
    for step in range(500):
        if step == 6:  # a sequence joins mid-run (in the tight pool it forces preemptions)
            for e in (fast, loop):
                e.add_request(request("late", random_prompt(5, 99), greedy(15)))
        if step in arrivals:
            n, m = specs[arrivals[step]]
            for e in (fast, loop):
                e.add_request(request(f"s{step}", random_prompt(n, 1000 + step), greedy(m)))
        if not (fast.has_unfinished() or loop.has_unfinished()) and step > max(arrivals, default=0):
            break
        got = []
        for name, e in (("fast", fast), ("loop", loop)):
            schedule = e.scheduler.schedule
            seen = {}

            def spy(kind=None, schedule=schedule, seen=seen, e=e):
                out = schedule(kind) if kind is not None else schedule()
                seen["state"] = state(e, out)
                return out

            e.scheduler.schedule = spy
            for d in e.step():
                outputs[name].setdefault(d.request_id, []).extend(d.token_ids)
            e.scheduler.schedule = schedule
            got.append(seen.get("state"))
        assert got[0] == got[1], f"step {step}"
    assert outputs["fast"] == outputs["loop"]
    assert taken["fast"] > 10 if traffic == "batch" else taken["runs"] > 5, taken
    if pool == "tight":
        assert fast.metrics.snapshot()["preemptions_total"] > 0


def test_sampling_batch_reuse_gives_the_same_samples(make_engine, monkeypatch):
    """Seeded sampling with the SamplingBatch carried from step to step (step counters moved on the
    device) equals rebuilding it every step; and the carried path is taken."""
    from engine.request import SamplingParams
    from engine.sampler import SamplingBatch

    def reqs():
        return [request(f"r{i}", random_prompt(n, i), SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=m))
                for i, (n, m) in enumerate(SPECS)]

    carried = {"n": 0}
    real_next = SamplingBatch.next_step

    def counting_next(self):
        carried["n"] += 1
        return real_next(self)

    monkeypatch.setattr(SamplingBatch, "next_step", counting_next)
    reuse, rebuild = make_engine(max_num_seqs=12, max_model_len=48), make_engine(max_num_seqs=12, max_model_len=48)
    rebuild.batches = lambda rows: SamplingBatch.build(
        [s.sampling for s in rows], [s.seed for s in rows], [len(s.output_ids) for s in rows], rebuild.runner.device)
    for e in (reuse, rebuild):
        for r in reqs():
            e.add_request(r)
    got, want = run_to_end(reuse), run_to_end(rebuild)
    assert {k: v["ids"] for k, v in got.items()} == {k: v["ids"] for k, v in want.items()}
    assert carried["n"] > 10


def test_pack_and_unpack_give_back_every_array():
    """The one-copy upload's packing (engine/step_arrays.upload): arrays of awkward sizes, empty ones among them,
    come back with their dtypes, shapes and values, each on an aligned offset of one buffer."""
    import torch

    from engine.step_arrays import UPLOAD_ALIGN, pack, unpack

    rng = np.random.default_rng()
    arrays = [rng.integers(-2**40, 2**40, 7), np.zeros(0, dtype=np.int64), rng.integers(0, 2**31 - 1, (3, 5), dtype=np.int32),
              rng.integers(0, 9, 1, dtype=np.int32), rng.integers(0, 2**31 - 1, (1, 1), dtype=np.int32).T,
              rng.integers(-5, 5, 13).astype(np.int64)[::2]]  # the last two not contiguous as given
    host, offsets = pack(arrays)
    assert host.dtype == torch.uint8 and all(o % UPLOAD_ALIGN == 0 for o in offsets)
    for a, t in zip(arrays, unpack(host, arrays, offsets)):
        assert t.dtype == torch.from_numpy(a[:0].reshape(-1)).dtype and tuple(t.shape) == a.shape
        assert np.array_equal(t.numpy(), a)
        assert t.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()


def test_to_inputs_on_cpu_keeps_the_host_arrays_values(make_engine):
    engine = make_engine()
    engine.add_request(request("a", random_prompt(37, seed=1), greedy(2)))
    out = engine.scheduler.schedule()
    arrays = build_step_arrays(out.scheduled, BLOCK)
    inputs = arrays.to_inputs("cpu")
    assert np.array_equal(inputs.input_ids.numpy(), arrays.input_ids)
    assert np.array_equal(inputs.attention.full.block_tables.numpy(), arrays.full_tables)
    assert np.array_equal(inputs.attention.sliding.slot_mapping.numpy(), arrays.sliding_slots)
    assert inputs.attention.full.kv_lens_cpu == arrays.full_lens.tolist()
