"""Engine health (engine/health.py): a device error, a dead rank, failed steps in a row, a hung step or a stopped
loop make `check_health` raise and new requests get refused; ordinary failures that stop do not."""

import asyncio
import threading
import time

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.distributed import WorkerFailedError, WorkerFailure
from engine.health import EngineHealth, HealthPolicy, fatal_cause
from engine.llm_engine import StepFailedError
from engine.request import EngineUnhealthyError
from tests.engine.engine_testlib import assert_pool_full, greedy, random_prompt, request

POISON = 999  # a prompt holding this token makes the injected fault fire


def _prompt(n: int, seed: int) -> list[int]:
    return [t for t in random_prompt(n + 10, seed) if t != POISON][:n]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _step_error(cause: BaseException) -> StepFailedError:
    """What LLMEngine raises when its forward raised `cause` (engine/llm_engine.py: `raise ... from exc`)."""
    try:
        try:
            raise cause
        except BaseException as exc:
            raise StepFailedError(f"decode step failed: {exc!r}", ["r"]) from exc
    except StepFailedError as err:
        return err


def test_policy_rejects_bad_values():
    for kwargs in ({"max_failed_steps": -1}, {"max_failed_steps": 1.5}, {"max_failed_steps": True},
                   {"step_timeout_s": 0}, {"step_timeout_s": -2.0}):
        with pytest.raises(ValueError):
            HealthPolicy(**kwargs)


def test_failures_in_a_row_count_and_a_success_resets_them():
    health = EngineHealth(HealthPolicy(max_failed_steps=3))
    for _ in range(2):
        health.step_started()
        health.step_failed(_step_error(RuntimeError("bad sampler input")))
    assert health.problem() is None
    health.step_started()
    health.step_succeeded()
    for _ in range(2):
        health.step_failed(_step_error(RuntimeError("bad sampler input")))
    assert health.problem() is None  # 2 in a row again, not 4
    health.step_failed(_step_error(RuntimeError("bad sampler input")))
    assert "3 steps failed in a row" in health.problem() and "bad sampler input" in health.problem()
    health.step_succeeded()
    assert health.problem() is None


def test_max_failed_steps_zero_never_counts():
    health = EngineHealth(HealthPolicy(max_failed_steps=0))
    for _ in range(50):
        health.step_failed(_step_error(RuntimeError("x")))
    assert health.problem() is None


@pytest.mark.parametrize("cause", [
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    WorkerFailedError(WorkerFailure(rank=2, detail="exit code -9")),
])
def test_a_device_error_or_a_dead_rank_is_fatal_at_once_and_stays(cause):
    health = EngineHealth(HealthPolicy(max_failed_steps=3))
    err = _step_error(cause)
    assert fatal_cause(err) is cause
    health.step_failed(err)
    problem = health.problem()
    assert problem is not None and type(cause).__name__ in problem and "cannot recover" in problem
    health.step_succeeded()  # a later step that returns does not make a lost device usable again
    assert health.problem() == problem


def test_ordinary_errors_are_not_fatal():
    assert fatal_cause(_step_error(RuntimeError("shape mismatch"))) is None
    assert fatal_cause(_step_error(torch.OutOfMemoryError("CUDA out of memory"))) is None  # not sticky
    assert fatal_cause(_step_error(ValueError("x"))) is None


def test_a_step_running_past_the_timeout_is_hung_until_it_returns():
    clock = Clock()
    health = EngineHealth(HealthPolicy(step_timeout_s=60.0), clock=clock)
    clock.now += 1000  # idle time is not a hang
    assert health.problem() is None
    health.step_started()
    clock.now += 59.0
    assert health.problem() is None
    clock.now += 2.0
    assert "running for 61 s" in health.problem() and "hung" in health.problem()
    health.step_succeeded()
    assert health.problem() is None
    never = EngineHealth(HealthPolicy(step_timeout_s=None), clock=clock)
    never.step_started()
    clock.now += 1e6
    assert never.problem() is None


# ---- the real engine thread, with a fault injected into the forward -----------------------------------------

def _faulty_engine(make_engine, fault, **policy) -> tuple[AsyncEngine, object]:
    """An AsyncEngine whose forward calls `fault()` for a batch holding POISON (and runs normally otherwise)."""
    llm = make_engine()
    real_execute = llm.runner.execute

    def execute(inputs):
        if POISON in inputs.input_ids.tolist():
            fault()
        return real_execute(inputs)

    llm.runner.execute = execute
    return AsyncEngine(llm, health=HealthPolicy(**policy)), llm


async def _run(engine: AsyncEngine, req) -> list[int]:
    return [t async for d in engine.generate(req) for t in d.token_ids]


def test_a_device_error_makes_the_engine_refuse_new_requests(make_engine, reference_greedy):
    def fault():
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    engine, llm = _faulty_engine(make_engine, fault)
    good = request("good", _prompt(7, 1), greedy(5))

    async def main():
        assert await _run(engine, good) == reference_greedy(good.prompt_ids, 5)
        engine.check_health()  # healthy: returns
        with pytest.raises(StepFailedError, match="illegal memory access"):
            await _run(engine, request("poison", [POISON] * 3, greedy(5)))
        with pytest.raises(EngineUnhealthyError, match="AcceleratorError.*illegal memory access"):
            engine.check_health()
        with pytest.raises(EngineUnhealthyError, match="cannot recover"):  # refused before it runs
            await _run(engine, request("after", _prompt(5, 2), greedy(3)))
        with pytest.raises(EngineUnhealthyError):
            await engine.prefill(request("after-prefill", _prompt(5, 3), greedy(3)))

    try:
        asyncio.run(main())
        assert "after" not in llm.seqs and "after-prefill" not in llm.seqs
        assert_pool_full(llm)  # the failed request's pages are back, nothing was admitted after
    finally:
        engine.shutdown()


def test_failed_steps_in_a_row_then_unhealthy(make_engine, reference_greedy):
    def fault():
        raise RuntimeError("simulated kernel bug")

    engine, llm = _faulty_engine(make_engine, fault, max_failed_steps=3)
    good = request("good", _prompt(9, 4), greedy(4))

    async def main():
        for i in range(2):
            with pytest.raises(StepFailedError):
                await _run(engine, request(f"p{i}", [POISON] * 2, greedy(2)))
        engine.check_health()  # 2 in a row: still serving
        assert await _run(engine, good) == reference_greedy(good.prompt_ids, 4)  # and a success resets the count
        for i in range(2, 4):
            with pytest.raises(StepFailedError):
                await _run(engine, request(f"p{i}", [POISON] * 2, greedy(2)))
        engine.check_health()
        with pytest.raises(StepFailedError):
            await _run(engine, request("p4", [POISON] * 2, greedy(2)))
        with pytest.raises(EngineUnhealthyError, match="3 steps failed in a row.*simulated kernel bug"):
            engine.check_health()

    try:
        asyncio.run(main())
        assert_pool_full(llm)
    finally:
        engine.shutdown()


def test_a_hung_step_is_reported_and_clears_when_it_returns(make_engine, reference_greedy):
    release = threading.Event()
    engine, llm = _faulty_engine(make_engine, lambda: release.wait(30), step_timeout_s=0.3)
    slow = request("slow", [POISON] + _prompt(4, 5), greedy(3))

    async def main():
        task = asyncio.ensure_future(_run(engine, slow))
        deadline = time.monotonic() + 10
        while True:
            try:
                engine.check_health()
            except EngineUnhealthyError as err:
                assert "hung" in str(err) and "step_timeout_s=0.3" in str(err)
                break
            assert time.monotonic() < deadline, "the hung step was never reported"
            await asyncio.sleep(0.05)
        release.set()
        ids = await task
        engine.check_health()  # it returned: serving again
        return ids

    try:
        assert len(asyncio.run(main())) == 3
        assert_pool_full(llm)
    finally:
        release.set()
        engine.shutdown()


def test_a_stopped_engine_is_unhealthy(make_engine):
    engine = AsyncEngine(make_engine())
    engine.check_health()
    engine.shutdown()
    with pytest.raises(EngineUnhealthyError, match="stopped: shut down"):
        engine.check_health()
