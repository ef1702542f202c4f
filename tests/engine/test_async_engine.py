"""AsyncEngine over the real engine thread: concurrent streams, abort, early exit, bad requests, a
failing step that takes down only its own requests, and the prefill -> decode hand-off."""

import asyncio
import time

import pytest
import torch

from engine.async_engine import AsyncEngine, merge_deltas
from engine.llm_engine import LLMEngine, StepFailedError
from engine.request import FINISH_ABORT, FINISH_LENGTH, InvalidRequestError, SamplingParams, TokenDelta, TokenLogprob
from tests.engine.engine_testlib import assert_pool_full, engine_config, greedy, random_prompt, request, run_to_end

POISON = 999  # a prompt made of this token makes the injected fault fire


def _prompt(n: int, seed: int) -> list[int]:
    return [t for t in random_prompt(n + 10, seed) if t != POISON][:n]


def _requests():
    reqs = [request(f"g{i}", _prompt(n, i), greedy(m)) for i, (n, m) in enumerate([(1, 9), (8, 6), (13, 8), (30, 4)])]
    reqs.append(request("s", _prompt(6, 9), SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=7)))
    return reqs


def _sync_outputs(make_engine, reqs) -> dict[str, list[int]]:
    engine = make_engine()
    for r in reqs:
        engine.add_request(r)
    return {rid: r["ids"] for rid, r in run_to_end(engine).items()}


async def _collect(stream) -> tuple[list[int], list]:
    ids, deltas = [], []
    async for d in stream:
        ids += d.token_ids
        deltas.append(d)
    return ids, deltas


async def _wait_idle(engine: AsyncEngine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = engine.metrics()
        if snap["full_pages_used"] == 0 and snap["num_running"] == 0 and snap["num_waiting"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.metrics()}")


def test_concurrent_streams_match_the_sync_engine(make_engine):
    reqs = _requests()
    expected = _sync_outputs(make_engine, reqs)
    engine = AsyncEngine(make_engine())

    async def main():
        return await asyncio.gather(*(_collect(engine.generate(r)) for r in reqs))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for r, (ids, deltas) in zip(reqs, results):
        assert ids == expected[r.request_id]
        assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [FINISH_LENGTH]
        assert deltas[-1].num_output_tokens == len(ids) and deltas[-1].num_prompt_tokens == len(r.prompt_ids)
    assert_pool_full(engine.engine)


def test_abort_and_early_exit_free_every_page(make_engine):
    engine = AsyncEngine(make_engine())

    async def main():
        stream = engine.generate(request("long", _prompt(10, 1), greedy(80)))
        got = [await stream.__anext__() for _ in range(3)]
        await engine.abort("long")
        rest = [d async for d in stream]
        assert rest[-1].finish_reason == FINISH_ABORT and all(d.finish_reason is None for d in got)
        async for d in engine.generate(request("leaver", _prompt(10, 2), greedy(80))):
            break  # the client disconnects: the generator's cleanup aborts the request
        await _wait_idle(engine)
        ids, _ = await _collect(engine.generate(request("after", _prompt(4, 3), greedy(3))))
        assert len(ids) == 3

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert engine.engine.metrics.snapshot()["requests_finished_total"] == {FINISH_ABORT: 2, FINISH_LENGTH: 1}
    assert_pool_full(engine.engine)


def test_bad_requests_fail_alone(make_engine):
    engine = AsyncEngine(make_engine())

    async def main():
        with pytest.raises(InvalidRequestError) as err:
            await _collect(engine.generate(request("bad", _prompt(4, 1), greedy(0))))
        assert err.value.param == "max_tokens"
        first = engine.generate(request("dup", _prompt(4, 2), greedy(30)))
        await first.__anext__()
        with pytest.raises(InvalidRequestError, match="already"):
            await _collect(engine.generate(request("dup", _prompt(4, 3), greedy(3))))
        ids, _ = await _collect(first)
        return ids

    try:
        assert len(asyncio.run(main())) == 29
    finally:
        engine.shutdown()


def test_a_failing_step_fails_only_its_requests(make_engine, reference_greedy):
    llm = make_engine()
    real_execute = llm.runner.execute

    def execute(inputs):  # injected fault: a device error on the poisoned prompt
        if POISON in inputs.input_ids.tolist():
            raise RuntimeError("simulated device fault")
        return real_execute(inputs)

    llm.runner.execute = execute
    engine = AsyncEngine(llm)
    good = request("good", _prompt(7, 5), greedy(5))

    async def main():
        with pytest.raises(StepFailedError, match="simulated device fault") as err:
            await _collect(engine.generate(request("poison", [POISON] * 3, greedy(5))))
        assert err.value.request_ids == ["poison"]
        return await _collect(engine.generate(good))

    try:
        ids, _ = asyncio.run(main())
    finally:
        engine.shutdown()
    assert ids == reference_greedy(good.prompt_ids, 5)
    assert_pool_full(llm)


@pytest.fixture
def prefill_and_decode(make_engine, other_model):
    """Two async engines on two copies of the model (a prefill and a decode replica), shut down after."""
    prefill, decode = AsyncEngine(make_engine()), AsyncEngine(LLMEngine(other_model, engine_config()))
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def test_async_prefill_then_decode_on_another_engine(make_engine, prefill_and_decode):
    reqs = _requests()
    expected = _sync_outputs(make_engine, reqs)
    prefill, decode = prefill_and_decode

    async def one(r):
        payload = await prefill.prefill(r)
        return await _collect(decode.generate_prefilled(r, payload))

    async def main():
        return await asyncio.gather(*(one(r) for r in reqs))

    results = asyncio.run(main())
    for r, (ids, deltas) in zip(reqs, results):
        assert ids == expected[r.request_id] and deltas[-1].finish_reason == FINISH_LENGTH
    assert prefill.metrics()["kv_exported_total"] == len(reqs) == decode.metrics()["kv_imported_total"]
    assert_pool_full(prefill.engine)
    assert_pool_full(decode.engine)


def test_async_prefill_into_a_destination_and_cancel_waits_for_the_abort(make_engine, prefill_and_decode):
    """prefill(request, into): the payload is the destination's tensors; a cancelled prefill with a
    destination returns only after the engine thread has dropped the request (nothing writes into the
    destination after the call ends)."""
    reqs = _requests()
    expected = _sync_outputs(make_engine, reqs)
    prefill, decode = prefill_and_decode
    given: dict[str, list] = {}

    def into_for(rid):
        def into(shapes, dtype):
            given[rid] = [torch.full(s, float("nan"), dtype=dtype) for s in shapes]
            return given[rid]
        return into

    async def one(r):
        payload = await prefill.prefill(r, into_for(r.request_id))
        assert [t.data_ptr() for t in (*payload.k, *payload.v)] == [t.data_ptr() for t in given[r.request_id]]
        return await _collect(decode.generate_prefilled(r, payload))

    async def cancelled():
        r = request("c", _prompt(40, 3), greedy(4))
        task = asyncio.ensure_future(prefill.prefill(r, into_for("c")))
        await asyncio.sleep(0)  # submitted, not yet done
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the abort has run on the engine thread: the request is gone, its pages are back
        assert "c" not in prefill.engine.seqs

    async def main():
        out = await asyncio.gather(*(one(r) for r in reqs))
        await cancelled()
        await _wait_idle(prefill)
        return out

    results = asyncio.run(main())
    for r, (ids, _) in zip(reqs, results):
        assert ids == expected[r.request_id]
    assert_pool_full(prefill.engine)


@pytest.mark.parametrize("coalesce", [True, False])
def test_deltas_queued_behind_a_slow_consumer_leave_as_one(make_engine, coalesce):
    """The consumer takes its first delta, then waits until the engine has finished the request: with
    coalescing the rest arrives as one delta (same tokens, same logprobs, the finish reason); without,
    one delta per engine step."""
    r = request("slow", _prompt(5, 3), greedy(7, logprobs=2))
    reference = run_to_end(_engine_with(make_engine, r))["slow"]
    engine = AsyncEngine(make_engine(), coalesce=coalesce)

    async def main():
        deltas = []
        async for delta in engine.generate(r):
            deltas.append(delta)
            if len(deltas) == 1:
                deadline = time.monotonic() + 10
                while engine.metrics()["requests_finished_total"].get("length", 0) < 1:
                    assert time.monotonic() < deadline, "the engine did not finish the request"
                    await asyncio.sleep(0.005)
                # The engine counts the request finished before it posts the step's deltas to this loop; a
                # command through the engine thread (aborting the finished request does nothing) is answered
                # after them, so every delta is queued once it returns (one CI run in ~10 saw the last one late)
                await engine.abort("slow", wait=True)
        return deltas

    try:
        deltas = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [t for d in deltas for t in d.token_ids] == reference["ids"]
    assert [lp for d in deltas for lp in d.logprobs] == reference["logprobs"]
    assert deltas[-1].finish_reason == FINISH_LENGTH and deltas[-1].num_output_tokens == 7
    assert len(deltas) == (2 if coalesce else reference["deltas"])
    assert reference["deltas"] == 7  # one token per step on this engine: the test would show nothing otherwise


def _engine_with(make_engine, r):
    engine = make_engine()
    engine.add_request(r)
    return engine


def test_stream_items_per_s_spaces_each_streams_deltas_by_the_open_streams_share(make_engine):
    """With a budget of B deltas per second and N streams open, a stream's deltas after its first leave at least
    N / B seconds apart and carry every token made meanwhile (the same tokens); a last delta does not wait."""
    reqs = [request(f"b{i}", _prompt(5, 20 + i), greedy(100)) for i in range(2)]
    expected = _sync_outputs(make_engine, reqs)
    budget = 40.0  # deltas per second for all streams: 50 ms between one stream's deltas while both are open
    engine = AsyncEngine(make_engine(), stream_items_per_s=budget)

    async def collect(r):
        start, out = time.monotonic(), []
        async for delta in engine.generate(r):
            out.append((time.monotonic() - start, delta))
        return out

    async def main():
        return await asyncio.gather(*(collect(r) for r in reqs))

    try:
        results = asyncio.run(main())
        items = engine.metrics()["stream_items_total"]
    finally:
        engine.shutdown()
    assert items == sum(len(timed) for timed in results)  # the metric counts the deltas the streams yielded
    for r, timed in zip(reqs, results):
        deltas = [d for _, d in timed]
        assert [t for d in deltas for t in d.token_ids] == expected[r.request_id]
        assert deltas[-1].finish_reason == FINISH_LENGTH and all(d.finish_reason is None for d in deltas[:-1])
        gaps = [b - a for (a, _), (b, _) in zip(timed, timed[1:])]
        assert len(gaps) >= 2, timed  # 100 engine steps take longer than one interval
        # the first interval passes while both streams generate: 2 / budget; later ones at least 1 / budget
        assert gaps[0] >= 2 / budget - 0.005 and all(gap >= 1 / budget - 0.005 for gap in gaps[1:-1]), gaps
        assert len(deltas) < len(expected[r.request_id]) / 2  # deltas carried several tokens
    with pytest.raises(ValueError, match="stream_items_per_s"):
        AsyncEngine(make_engine(), stream_items_per_s=-1)


def test_merge_deltas_keeps_every_token_logprob_and_the_last_counts():
    """A stream's queued deltas merged in one pass: tokens and logprobs in order (a delta without logprobs adds
    none), the most cached tokens any of them reported, the last one's counts and finish reason; one delta is
    itself."""
    lp = [TokenLogprob(t, -0.5 * t, []) for t in range(6)]
    parts = [TokenDelta("r", [0, 1], lp[:2], None, 9, 2, 0),
             TokenDelta("r", [2], None, None, 9, 3, 4, 1, 1),
             TokenDelta("r", [3, 4, 5], lp[3:], FINISH_LENGTH, 9, 6, 2, 3, 2)]
    merged = merge_deltas(parts)
    assert merged == TokenDelta("r", [0, 1, 2, 3, 4, 5], lp[:2] + lp[3:], FINISH_LENGTH, 9, 6, 4, 3, 2)
    assert merge_deltas([parts[1]]) is parts[1]
    plain = [TokenDelta("r", [7], None, None, 9, 1), TokenDelta("r", [8], None, None, 9, 2)]
    assert merge_deltas(plain) == TokenDelta("r", [7, 8], None, None, 9, 2)
    assert parts[0].token_ids == [0, 1] and parts[0].logprobs == lp[:2]  # the parts are not changed
