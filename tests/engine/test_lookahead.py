"""The lookahead (EngineConfig.async_decode; engine/llm_engine.py): the next step scheduled and launched
before this one's tokens are read gives the same tokens, logprobs, finish reasons and page accounting as
stepping synchronously. The scenarios of test_llm_engine run again with it on (CPU: the same code
paths, without the overlap), each checking that lookahead steps did happen. Several ranks:
tests/engine/test_parallel_engine.py."""

import pytest
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig, EngineConfigError
from engine.llm_engine import LLMEngine, StepFailedError
from engine.metrics import PrometheusCollector
from engine.request import FINISH_ABORT, FINISH_STOP
from engine.scheduler import StepKind
from engine.sequence import PLACEHOLDER
from tests.engine import test_llm_engine as scenarios
from tests.engine.engine_testlib import (assert_pool_full, engine_config, greedy, random_prompt, request, run_to_end,
                                         with_requests)

ENGINES: list[LLMEngine] = []


@pytest.fixture
def make_lookahead(model):
    ENGINES.clear()

    def make(**overrides) -> LLMEngine:
        engine = LLMEngine(model, engine_config(async_decode=True, **overrides))
        ENGINES.append(engine)
        return engine
    yield make
    assert sum(e.lookahead_steps for e in ENGINES) > 0, "no step ever ran ahead: the scenario tested nothing new"


def run_both(make_engine, make_lookahead, reqs, **overrides) -> tuple[dict, dict, LLMEngine]:
    sync, ahead = make_engine(**overrides), make_lookahead(**overrides)
    for engine in (sync, ahead):
        for r in reqs:
            engine.add_request(r)
    return run_to_end(sync), run_to_end(ahead), ahead


def test_off_by_default_on_cpu_and_typed_errors(model):
    assert LLMEngine(model, engine_config()).async_decode is False
    with pytest.raises(EngineConfigError, match="async_decode"):
        EngineConfig(async_decode="yes")


def test_same_results_as_stepping_synchronously(make_engine, make_lookahead):
    reqs = scenarios.mixed_requests()
    probe = run_to_end(with_requests(make_engine(), [reqs[0]]))["g0"]["ids"]
    stop = next(t for i, t in enumerate(probe) if i >= 3 and t not in probe[:i])
    reqs.append(request("stop", list(reqs[0].prompt_ids), greedy(12, stop_token_ids=(stop,))))
    sync, ahead, engine = run_both(make_engine, make_lookahead, reqs)
    assert ahead == sync  # ids, logprobs, finish reasons, and one delta per token
    assert ahead["stop"]["finish"] == FINISH_STOP and ahead["stop"]["ids"][-1] == stop
    assert engine.lookahead_steps > 0
    # decode tokens count what was generated: the row computed ahead for the stopped request is not one
    generated = sum(len(r["ids"]) - 1 for r in ahead.values())  # each request's first token came from prefill
    assert engine.metrics.snapshot()["decode_tokens_total"] == generated
    registry = CollectorRegistry()  # the counter reaches Prometheus
    registry.register(PrometheusCollector(engine.metrics))
    assert registry.get_sample_value("gptoss_engine_lookahead_steps_total") == engine.lookahead_steps
    assert_pool_full(engine)


@pytest.mark.parametrize("ahead", [False, True])
def test_the_common_row_shortcut_changes_nothing(make_engine, model, monkeypatch, ahead):
    """`LLMEngine._resolve`'s shortcut for rows of one token without logprobs, constraint or drafter gives the
    tokens, logprobs, finish reasons, deltas, token counts, first-token records and pages of the general body,
    with and without the lookahead, on requests that mix it with logprobs rows, stop tokens, length limits and
    prompts joining a decoding batch."""
    import engine.step_flight as step_flight
    reqs = scenarios.mixed_requests()
    probe = run_to_end(with_requests(make_engine(), [reqs[0]]))["g0"]["ids"]
    stop = next(t for i, t in enumerate(probe) if i >= 3 and t not in probe[:i])
    reqs.append(request("stop", list(reqs[0].prompt_ids), greedy(12, stop_token_ids=(stop,))))
    general_rows = []
    counted = step_flight.accepted_drafts  # the general body's first call for each row

    def counting(*args):
        general_rows.append(args[0].request_id)
        return counted(*args)
    monkeypatch.setattr(step_flight, "accepted_drafts", counting)
    results, rows = {}, {}
    for fast in (False, True):
        engine = LLMEngine(model, engine_config(async_decode=ahead, max_num_batched_tokens=24))
        engine.fast_rows = fast
        general_rows.clear()
        for r in reqs[:4]:
            engine.add_request(r)
        first = [engine.step() for _ in range(3)]  # later requests join a batch that is already decoding
        for r in reqs[4:]:
            engine.add_request(r)
        done = run_to_end(engine)
        counts = {k: v for k, v in engine.metrics.snapshot().items() if k.endswith("_total")}
        results[fast] = (first, done, counts, engine.metrics.snapshot()["ttft_seconds"]["count"])
        rows[fast] = list(general_rows)
        assert_pool_full(engine)
        assert (engine.lookahead_steps > 0) == ahead
    assert results[True] == results[False]
    assert results[True][1]["stop"]["finish"] == FINISH_STOP and results[True][3] == len(reqs)
    # the shortcut took every row but those with logprobs (s1, l0); the general body took them all
    assert set(rows[True]) == {"s1", "l0"} and set(rows[False]) == {r.request_id for r in reqs}


def test_placeholders_inside_mixed_steps_are_fed_on_the_device(make_engine, make_lookahead, monkeypatch):
    """Steps that join new prompts, chunk long ones and preempt under a tiny pool: the inputs of a step
    launched ahead hold placeholders at other places than 'one decode row each' (a sequence sampled
    its first token at the end of a prefill chunk, a preempted one is recomputed); each is replaced by
    the sampled id and the results equal synchronous stepping."""
    patched = []
    feed = LLMEngine._feed

    def counting(inputs, out, cur):
        fed = feed(inputs, out, cur)
        if fed.input_ids is not inputs.input_ids and fed.input_ids is not cur.sampled.token_ids:
            patched.append(int((inputs.input_ids != fed.input_ids).sum()))
        return fed

    monkeypatch.setattr(LLMEngine, "_feed", staticmethod(counting))
    reqs = scenarios.mixed_requests()
    tiny = dict(max_model_len=48, num_full_pages=14, num_sliding_pages=6, max_num_batched_tokens=16)
    sync, ahead, engine = run_both(make_engine, make_lookahead, reqs, **tiny)
    assert ahead == sync
    assert engine.metrics.snapshot()["preemptions_total"] > 0
    assert patched and all(n >= 1 for n in patched)
    assert_pool_full(engine)


@pytest.mark.parametrize("scenario", [
    "test_concurrent_requests_equal_each_alone_and_the_reference",
    "test_preemption_under_a_tiny_pool_gives_identical_outputs",
    "test_abort_everywhere_returns_every_page",
    "test_stop_tokens_ignore_eos_and_context_limit",
    "test_logprobs_match_the_reference_distribution",
    "test_seeded_sampling_reproducible_and_seed_dependent",
    "test_separate_prefill_and_decode_steps_on_one_engine",
])
def test_engine_scenarios_with_lookahead(scenario, make_lookahead, reference_greedy, model):
    fn = getattr(scenarios, scenario)
    kwargs = {"make_engine": make_lookahead, "reference_greedy": reference_greedy, "model": model}
    fn(**{k: v for k, v in kwargs.items() if k in fn.__code__.co_varnames[:fn.__code__.co_argcount]})


@pytest.mark.parametrize("export_into", [False, True])
@pytest.mark.parametrize("decode_kind", [StepKind.DECODE, StepKind.MIXED])
def test_prefill_export_then_import_with_lookahead(make_lookahead, model, decode_kind, export_into):
    scenarios.test_prefill_export_then_import_equals_one_engine(make_lookahead, model, decode_kind, export_into)


def test_abort_while_a_step_is_in_flight(make_engine, make_lookahead):
    reqs = [request("a", random_prompt(5, 1), greedy(10)), request("b", random_prompt(7, 2), greedy(10))]
    expected = run_to_end(with_requests(make_engine(), reqs))
    engine = with_requests(make_lookahead(), reqs)
    got = {"a": [], "b": []}
    while engine._inflight is None:
        for d in engine.step():
            got[d.request_id] += d.token_ids
    delta = engine.abort("a")  # its next token is being computed right now
    assert delta.finish_reason == FINISH_ABORT and PLACEHOLDER not in delta.token_ids
    assert got["a"] + delta.token_ids == expected["a"]["ids"][: len(got["a"]) + len(delta.token_ids)]
    for rid, r in run_to_end(engine).items():
        got[rid] += r["ids"]
    assert got["b"] == expected["b"]["ids"]
    assert_pool_full(engine)


def test_a_failing_lookahead_step_fails_both_steps_requests(make_lookahead, monkeypatch):
    engine = with_requests(make_lookahead(), [request("a", random_prompt(4, 3), greedy(12)),
                                      request("b", random_prompt(6, 4), greedy(12))])
    real = engine.runner.execute
    calls = []

    def execute(inputs):
        calls.append(1)
        if len(calls) == 3:  # prefill, first decode, then the second decode launched ahead of it
            raise RuntimeError("device lost")
        return real(inputs)

    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.step()  # the prefill: first tokens are read before anything is launched ahead
    with pytest.raises(StepFailedError) as err:
        engine.step()
    assert sorted(set(err.value.request_ids)) == ["a", "b"]
    for rid in set(err.value.request_ids):  # what AsyncEngine does with a failed step
        delta = engine.abort(rid)
        assert PLACEHOLDER not in delta.token_ids
    assert not engine.has_unfinished() and engine._inflight is None
    assert_pool_full(engine)


def test_a_first_token_is_read_before_an_eager_step_is_launched(make_lookahead, monkeypatch):
    """TTFT: after a step that samples a prompt's first token, the engine does not launch the next step
    ahead unless it will be a quick graph replay (never on CPU); later decode steps do run ahead."""
    engine = with_requests(make_lookahead(), [request("a", random_prompt(9, 5), greedy(6))])
    ahead_after_first = []
    while engine.has_unfinished():
        deltas = engine.step()
        if any(d.num_output_tokens == 1 for d in deltas):
            ahead_after_first.append(engine._inflight is not None)
    assert ahead_after_first == [False]
    assert engine.lookahead_steps > 0


def test_abort_of_a_request_whose_last_token_is_in_flight(make_engine, make_lookahead):
    """Aborted between two steps while the step in flight gives it its last token: its delta holds only
    read tokens, the step's row for it is dropped, and the other request goes on as without the abort."""
    reqs = [request("short", random_prompt(5, 6), greedy(4)), request("long", random_prompt(6, 7), greedy(9))]
    expected = run_to_end(with_requests(make_engine(), reqs))
    engine = with_requests(make_lookahead(), reqs)
    got = {"short": [], "long": []}
    short = engine.seqs["short"]
    while not (engine._inflight is not None and short in engine._inflight.rows
               and short.finishes_by_length(engine.max_model_len)):
        for d in engine.step():
            got[d.request_id] += d.token_ids
    delta = engine.abort("short")
    assert delta.finish_reason == FINISH_ABORT and PLACEHOLDER not in delta.token_ids
    for rid, r in run_to_end(engine).items():
        got[rid] += r["ids"]
    assert got["long"] == expected["long"]["ids"]
    assert got["short"] + delta.token_ids == expected["short"]["ids"][:3]
    assert_pool_full(engine)


def test_a_failing_deferred_sampler_fails_its_step_when_read(make_lookahead, monkeypatch):
    """A penalized row defers the sampling of the step launched ahead until the step before is read. If that
    sampler raises, the step before still delivers its tokens, and reading the failed step raises
    StepFailedError for its requests (which the caller aborts)."""
    engine = with_requests(make_lookahead(), [request("a", random_prompt(4, 3), greedy(12, presence_penalty=0.5)),
                                      request("b", random_prompt(6, 4), greedy(12))])
    real = engine.sampler
    calls = []

    def sampler(logits, batch):
        calls.append(1)
        if len(calls) == 3:  # prefill, first decode, then the deferred one of the decode launched ahead
            raise RuntimeError("sampler failed")
        return real(logits, batch)

    monkeypatch.setattr(engine, "sampler", sampler)
    engine.step()  # the prefill: first tokens are read before anything is launched ahead
    deltas = engine.step()  # the first decode: read; the step after it launched ahead, its sampler failed
    assert sorted(d.request_id for d in deltas) == ["a", "b"] and all(len(d.token_ids) == 1 for d in deltas)
    assert engine._inflight is not None and engine._inflight.failure is not None
    with pytest.raises(StepFailedError) as err:
        engine.step()
    assert sorted(set(err.value.request_ids)) == ["a", "b"]
    for rid in set(err.value.request_ids):
        assert PLACEHOLDER not in engine.abort(rid).token_ids
    assert not engine.has_unfinished() and engine._inflight is None
    assert_pool_full(engine)


class _StopAware:
    """A test constraint (every id allowed) that refuses to give a mask once it has seen its stop token: the
    row a lookahead step computed for a sequence that stopped must sample without asking it."""

    def __init__(self, stop: int):
        self.stop, self.seen = stop, []

    def allowed_tokens(self):
        assert self.stop not in self.seen, "asked for a mask after the output ended"
        return None

    def accept(self, token_id: int) -> None:
        self.seen.append(token_id)

    def can_look_ahead(self) -> bool:
        return False


class _StopAwareSpec:
    def __init__(self, stop: int):
        self.stop = stop

    def start(self, vocab_size: int) -> _StopAware:
        return _StopAware(self.stop)


def test_a_constrained_row_that_stopped_is_not_masked_in_the_step_launched_ahead(make_engine, make_lookahead):
    prompt = random_prompt(5, 8)
    probe = run_to_end(with_requests(make_engine(), [request("c", prompt, greedy(12))]))["c"]["ids"]
    stop = next(t for i, t in enumerate(probe) if i >= 3 and t not in probe[:i])
    reqs = [request("c", prompt, greedy(12, stop_token_ids=(stop,), constraint=_StopAwareSpec(stop))),
            request("free", random_prompt(7, 9), greedy(16))]
    sync, ahead, engine = run_both(make_engine, make_lookahead, reqs)
    assert ahead == sync and ahead["c"]["finish"] == FINISH_STOP and ahead["c"]["ids"][-1] == stop
    assert engine.lookahead_steps > 0
    assert_pool_full(engine)
