"""Priority scheduling (GenerateRequest.priority, lower first): waiting requests are admitted by (priority,
arrival); a better-priority request that finds no batch slot or no pages preempts running ones of worse
priority, the worst and newest first; equal priorities stay first come, first served. Every request still gets
exactly the tokens it gets alone."""

from __future__ import annotations

import pytest

from engine.request import GenerateRequest, InvalidRequestError
from tests.engine.engine_testlib import assert_pool_full, greedy, random_prompt, run_to_end


def req(rid: str, priority: int, prompt_len: int = 6, max_tokens: int = 20, seed: int = 0) -> GenerateRequest:
    return GenerateRequest(rid, random_prompt(prompt_len, seed), greedy(max_tokens), priority=priority)


def finish_order(engine, limit: int = 5_000) -> tuple[list[str], dict[str, list[int]]]:
    order, tokens = [], {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return order, tokens
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason is not None:
                order.append(d.request_id)
    raise AssertionError("engine still busy")


def alone(make_engine, r: GenerateRequest) -> list[int]:
    engine = make_engine()
    engine.add_request(GenerateRequest(r.request_id, r.prompt_ids, r.sampling))
    return run_to_end(engine)[r.request_id]["ids"]


def test_a_better_priority_takes_a_batch_slot_from_the_newest_worse_one(make_engine):
    engine = make_engine(max_num_seqs=2)
    lows = [req("low-a", 5, max_tokens=40, seed=1), req("low-b", 5, max_tokens=40, seed=2)]
    for r in lows:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    urgent = req("urgent", 0, max_tokens=8, seed=3)
    engine.add_request(urgent)
    engine.step()
    assert engine.seqs["low-b"].num_preemptions == 1 and engine.seqs["low-a"].num_preemptions == 0
    order, _ = finish_order(engine)
    assert order[0] == "urgent" and engine.metrics.snapshot()["preemptions_total"] == 1
    assert_pool_full(engine)


@pytest.fixture(params=["sync", "lookahead"])
def make_engine_both(request, make_engine):
    """make_engine, and the engine that schedules and launches a step before reading the one before
    (async_decode: its preemptions can hit a sequence whose token is in flight)."""
    made = []

    def make(**overrides):
        made.append(make_engine(**overrides, **({"async_decode": True} if request.param == "lookahead" else {})))
        return made[-1]
    yield make
    if request.param == "lookahead":
        assert made[0].lookahead_steps > 0, "no step ran ahead: the lookahead case tested nothing"


def test_every_request_keeps_its_tokens_when_preempted_for_priority(make_engine, make_engine_both):
    engine = make_engine_both(max_num_seqs=2)
    reqs = [req("low-a", 5, max_tokens=30, seed=1), req("low-b", 5, max_tokens=30, seed=2)]
    out: dict[str, list[int]] = {}
    for r in reqs:
        engine.add_request(r)
    for _ in range(4):
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    reqs.append(req("urgent", -3, max_tokens=10, seed=3))
    engine.add_request(reqs[-1])
    order, rest = finish_order(engine)
    for rid, ids in rest.items():
        out.setdefault(rid, []).extend(ids)
    assert order.index("urgent") < order.index("low-b")
    assert engine.metrics.snapshot()["preemptions_total"] >= 1
    for r in reqs:
        assert out[r.request_id] == alone(make_engine, r), r.request_id
    assert_pool_full(engine)


def test_a_better_priority_takes_pages_from_worse_ones(make_engine, make_engine_both):
    # 12 full pages of 4 tokens: two long low-priority requests fill the pool, the urgent one needs pages
    engine = make_engine_both(num_full_pages=12, num_sliding_pages=12, max_model_len=48)
    reqs = [req("low-a", 1, prompt_len=16, max_tokens=24, seed=4),
            req("low-b", 1, prompt_len=16, max_tokens=24, seed=5)]
    out: dict[str, list[int]] = {}
    for r in reqs:
        engine.add_request(r)
    for _ in range(6):
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    reqs.append(req("urgent", 0, prompt_len=16, max_tokens=6, seed=6))
    engine.add_request(reqs[-1])
    for d in engine.step():
        out.setdefault(d.request_id, []).extend(d.token_ids)
    assert engine.seqs["urgent"].num_computed > 0  # admitted at once
    order, rest = finish_order(engine)
    for rid, ids in rest.items():
        out.setdefault(rid, []).extend(ids)
    assert order[0] == "urgent"
    for r in reqs:
        assert out[r.request_id] == alone(make_engine, r), r.request_id
    assert_pool_full(engine)


def test_waiting_requests_start_by_priority_and_equal_ones_never_preempt(make_engine):
    engine = make_engine(max_num_seqs=1)
    for r in (req("first", 0, seed=7), req("late-low", 3, seed=8), req("mid", 1, seed=9), req("mid-2", 1, seed=10)):
        engine.add_request(r)
    order, _ = finish_order(engine)
    assert order == ["first", "mid", "mid-2", "late-low"]
    assert engine.metrics.snapshot()["preemptions_total"] == 0  # nobody waiting was better than who ran


@pytest.mark.parametrize("gap_s, aging_s, want", [
    (0.0, None, ["running", "high", "low"]),  # strict priority
    (0.25, None, ["running", "high", "low"]),
    (0.0, 0.05, ["running", "high", "low"]),  # aged, but the better one came within 0.05 s
    (0.25, 0.05, ["running", "low", "high"]),  # aged: 0.25 s of waiting outweighs one priority step
])
def test_priority_aging_lets_a_long_waiting_request_go_first(make_engine, gap_s, aging_s, want):
    """priority_aging_s: a worse-priority request that waited longer than aging_s x the difference is admitted
    before a better one that arrived later (it cannot starve); the better one still does not preempt it."""
    import time

    engine = make_engine(max_num_seqs=1, priority_aging_s=aging_s)
    engine.add_request(req("running", 0, max_tokens=6, seed=11))
    engine.step()  # it holds the only seat
    engine.add_request(req("low", 1, max_tokens=4, seed=12))
    time.sleep(gap_s)
    engine.add_request(req("high", 0, max_tokens=4, seed=13))
    order, out = finish_order(engine)
    assert order == want
    assert engine.metrics.snapshot()["preemptions_total"] == 0
    for r in (req("low", 1, max_tokens=4, seed=12), req("high", 0, max_tokens=4, seed=13)):
        assert out[r.request_id] == alone(make_engine, r)


def test_an_aged_request_still_yields_its_seat_to_a_much_better_one(make_engine):
    """Aging moves a request forward in the queue; a running request of worse priority is still preempted by a
    better one that outranks it in that order."""
    engine = make_engine(max_num_seqs=1, priority_aging_s=1000.0)
    engine.add_request(req("low", 5, max_tokens=30, seed=14))
    for _ in range(3):
        engine.step()
    engine.add_request(req("urgent", 0, max_tokens=4, seed=15))
    order, _ = finish_order(engine)
    assert order == ["urgent", "low"] and engine.seqs == {}
    assert engine.metrics.snapshot()["preemptions_total"] == 1


def test_priority_aging_must_be_positive(make_engine):
    from engine.config import EngineConfig, EngineConfigError

    for bad in (0, -1.0, float("nan"), float("inf"), True, "30"):
        with pytest.raises(EngineConfigError, match="priority_aging_s"):
            EngineConfig(priority_aging_s=bad)


@pytest.mark.parametrize("priority", [True, 1.0, "1", 2**31, -(2**31) - 1])
def test_priority_must_be_a_32_bit_integer(make_engine, priority):
    with pytest.raises(InvalidRequestError) as err:
        make_engine().add_request(GenerateRequest("bad", [1, 2, 3], greedy(2), priority=priority))
    assert err.value.param == "priority"


def test_an_imported_urgent_request_preempts_imported_worse_ones(make_engine):
    """The disaggregated path: K/V exported by a prefill engine and imported into a decode engine whose two
    seats hold worse-priority requests; the urgent import is admitted at the next step, the newest worse one
    recomputes locally, and every request's tokens equal those of one engine running it alone."""
    reqs = [req("low-a", 4, max_tokens=30, seed=11), req("low-b", 4, max_tokens=30, seed=12),
            req("urgent", 0, max_tokens=8, seed=13)]
    prefill, decode = make_engine(), make_engine(max_num_seqs=2)
    for r in reqs:
        prefill.add_request(r, prefill_only=True)
    run_to_end(prefill, prefill.step_prefill)
    payloads = {r.request_id: prefill.export_kv(r.request_id) for r in reqs}
    out: dict[str, list[int]] = {}

    def record(deltas) -> None:
        for d in deltas:
            out.setdefault(d.request_id, []).extend(d.token_ids)

    for r in reqs[:2]:
        record(decode.import_prefilled(r, payloads[r.request_id]))
    for _ in range(3):
        record(decode.step())
    record(decode.import_prefilled(reqs[2], payloads["urgent"]))
    record(decode.step())
    assert decode.seqs["urgent"].num_computed > 0 and decode.seqs["low-b"].num_preemptions == 1
    order, rest = finish_order(decode)
    for rid, ids in rest.items():
        out.setdefault(rid, []).extend(ids)
    assert order[0] == "urgent"
    for r in reqs:
        assert out[r.request_id] == alone(make_engine, r), r.request_id
    assert_pool_full(decode)
