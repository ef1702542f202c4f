"""Speculative decoding from predicted outputs and prompt lookup (engine/speculative.py): drafts change how
many tokens a step yields, never which tokens. Every scenario runs against the same engine without
speculation (greedy and seeded sampling, logprobs, stop tokens, limits, preemption, lookahead) and checks
that drafts were really verified and accepted, so none passes by never speculating."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig, EngineConfigError
from engine.llm_engine import LLMEngine
from engine.metrics import PrometheusCollector
from engine.request import FINISH_LENGTH, FINISH_STOP, InvalidRequestError, SamplingParams
from engine.scheduler import ScheduledSeq
from engine.speculative import MAX_REST, Drafter, ngram_starts
from engine.step_arrays import build_step_arrays
from tests.engine.engine_testlib import (BLOCK, assert_pool_full, greedy, random_prompt, request, run_to_end,
                                         with_requests)


def sampled(max_tokens: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=seed, max_tokens=max_tokens, **kw)


def predicting(params: SamplingParams, prediction) -> SamplingParams:
    return dataclasses.replace(params, prediction=tuple(prediction))


def outputs(engine: LLMEngine, reqs) -> dict[str, dict]:
    return run_to_end(with_requests(engine, reqs))


def without_speculation(make_engine, reqs, **overrides) -> dict[str, dict]:
    plain = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, prediction=())) for r in reqs]
    return outputs(make_engine(speculative_tokens=0, **overrides), plain)


def assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for rid, want in expected.items():
        assert got[rid]["ids"] == want["ids"], rid
        assert got[rid]["finish"] == want["finish"], rid
        assert len(got[rid]["logprobs"]) == len(want["logprobs"]), rid
        for a, b in zip(got[rid]["logprobs"], want["logprobs"]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4, rid
            assert [t for t, _ in a.top] == [t for t, _ in b.top], rid


def edited(tokens: list[int], seed: int) -> list[int]:
    """An edit of a predicted output: a few tokens replaced, some inserted, a stretch deleted."""
    rng = np.random.default_rng(seed)
    out = list(tokens)
    for i in rng.choice(len(out), size=max(1, len(out) // 10), replace=False):
        out[i] = (out[i] + 17) % 1000
    cut = len(out) // 2
    return out[:cut] + [3, 1, 4] + out[cut + 3:]


# ---- the drafter alone ---------------------------------------------------------------------------------

def test_ngram_starts_finds_every_match_with_a_token_after_it():
    corpus = np.array([5, 1, 2, 5, 1, 2, 7, 5, 1], dtype=np.int64)
    assert ngram_starts(corpus, np.array([5, 1])).tolist() == [0, 3]  # (the match at 7 has nothing after it)
    assert ngram_starts(corpus, np.array([1, 2, 7])).tolist() == [4]
    assert ngram_starts(corpus, np.array([9])).tolist() == []
    assert ngram_starts(corpus[:2], np.array([5, 1])).tolist() == []


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence():
    d = Drafter([10, 11, 12, 13, 10, 11, 14, 15, 99, 10], None, lookup_context=True, max_tokens=3)
    assert d.propose(8) == []  # a single repeated token is below NGRAM_MIN
    d.observe([11])  # tail (10, 11): seen at 0 and 4, the latest wins
    assert d.propose(8) == [14, 15, 99]
    assert d.propose(2) == [14, 15]


def test_reference_pointer_follows_agreement_and_realigns_forward():
    ref = [1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 20]
    d = Drafter([100], tuple(ref), lookup_context=False, max_tokens=4)
    assert d.propose(10) == [1, 2, 3, 4]  # nothing generated yet: the prediction from its start
    d.observe([1])
    d.observe([2, 3, 4, 5, 6], drafted=4, accepted=4)
    assert d.propose(10) == [7, 8, 9, 2]
    d.observe([7, 50], drafted=4, accepted=1)  # the output left the prediction
    assert d.cap == 2 and d.propose(10) == []  # no match for its tail
    d.observe([2, 3, 4])  # (2, 3, 4) occurs at 1 and 9: the one after the last position read (8) wins
    assert d.ref_pos == 12 and d.propose(10) == [20]
    assert (d.num_drafted, d.num_accepted) == (8, 5)


def test_drafts_rejected_whole_rest_the_drafter_longer_each_time():
    ref = list(range(100, 140))
    d = Drafter([1], tuple(ref), lookup_context=False, max_tokens=4)
    rests = []
    for _ in range(7):  # every draft is rejected whole
        draft = d.propose(10)
        assert draft
        d.observe([draft[0] + 1000], drafted=len(draft), accepted=0)
        d.ref_pos = 0  # (as if the output realigned with the prediction at once)
        steps = 0
        while not d.may_propose():
            assert d.propose(10) == []
            d.observe([])
            steps += 1
        rests.append(steps)
    assert rests == [1, 2, 4, 8, 16, MAX_REST, MAX_REST]
    d.observe([d.propose(10)[0]], drafted=1, accepted=1)  # any accepted token ends the backoff
    assert d.last_rest == 0 and d.may_propose()
    d.ref_pos = len(ref)  # the prediction used up: no source left
    assert not d.may_propose() and d.propose(10) == []


def test_a_prompt_lookup_that_finds_nothing_rests():
    d = Drafter([1, 2, 3, 4], None, lookup_context=True, max_tokens=4)
    assert d.may_propose() and d.propose(4) == []  # (4,) has no earlier occurrence
    assert not d.may_propose()
    d.observe([1])
    assert d.may_propose()  # a rest of one step
    assert d.propose(4) == []
    d.observe([2])  # (1, 2) now occurs earlier, but the drafter rests for two steps
    assert not d.may_propose()
    d.observe([5])
    assert d.may_propose()


# ---- step metadata ------------------------------------------------------------------------------------------

def test_a_draft_runs_as_decode_rows_over_the_sequence_pages(make_engine):
    engine = make_engine()
    engine.add_request(request("a", random_prompt(9, 1), greedy(20)))
    engine.step()  # prefill: 9 prompt tokens cached, one output
    seq = engine.seqs["a"]
    engine.block_manager.allocate(seq, seq.num_computed + 4)
    arrays = build_step_arrays([ScheduledSeq(seq, 9, 4, False, (7, 8, 9))], BLOCK)
    assert arrays.input_ids.tolist() == [seq.output_ids[-1], 7, 8, 9]
    assert arrays.positions.tolist() == [9, 10, 11, 12]
    assert arrays.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert arrays.full_lens.tolist() == [10, 11, 12, 13]
    assert arrays.sample_rows == [0, 0, 0, 0] and arrays.logits_indices.tolist() == [0, 1, 2, 3]
    pages = seq.full_pages.array()
    assert arrays.full_slots.tolist() == [int(pages[p // BLOCK]) * BLOCK + p % BLOCK for p in range(9, 13)]
    assert (arrays.full_tables == arrays.full_tables[0]).all()


# ---- the engine -------------------------------------------------------------------------------------------

def test_predicted_outputs_give_the_same_tokens_in_fewer_steps(make_engine):
    prompt = random_prompt(13, 1)
    expected = without_speculation(make_engine, [request("a", prompt, greedy(40))])
    ref = expected["a"]["ids"]
    for prediction, min_accepted in ((ref, 30), (edited(ref, 0), 10), (random_prompt(40, 9), 0)):
        engine = make_engine()
        got = outputs(engine, [request("a", prompt, predicting(greedy(40), prediction))])
        assert_same(got, expected)
        snap = engine.metrics.snapshot()
        assert snap["draft_accepted_total"] >= min_accepted, (snap, prediction)
        if min_accepted:
            assert got["a"]["deltas"] < len(ref)  # several tokens per step
        assert_pool_full(engine)


def test_the_engine_looks_ahead_while_the_prediction_does_not_match(make_engine):
    # The prediction agrees on the first token only (its first draft is rejected whole), then either never
    # again or from the output's 31st token on: the steps in between run ahead (lookahead) instead of
    # synchronously, and the drafts resume once the pointer realigns.
    prompt = random_prompt(13, 2)
    lookahead = dict(async_decode=True)
    expected = without_speculation(make_engine, [request("a", prompt, greedy(60))], **lookahead)
    ref = expected["a"]["ids"]
    for prediction, accepts in ((ref[:1] + random_prompt(40, 77), False), (ref[:1] + random_prompt(12, 78) + ref[30:], True)):
        engine = make_engine(**lookahead)
        got = outputs(engine, [request("a", prompt, predicting(greedy(60), prediction))])
        assert_same(got, expected)
        snap = engine.metrics.snapshot()
        assert snap["draft_tokens_total"] > 0, snap
        assert snap["lookahead_steps_total"] > 20, snap  # (none before drafters said when they will not draft)
        assert (snap["draft_accepted_total"] >= 15) == accepts, snap
        assert_pool_full(engine)


@pytest.mark.parametrize("lookahead", [False, True])
def test_mixed_batches_match_the_engine_without_speculation(make_engine, lookahead):
    # Greedy and seeded sampling with logprobs, prediction and prompt lookup, next to requests that cannot
    # speculate (penalties): with lookahead on, the latter's batches still run ahead when nobody drafts.
    probe = without_speculation(make_engine, [request(f"p{i}", random_prompt(6 + i, 20 + i),
                                                      sampled(24, seed=i, logprobs=2) if i % 2 else greedy(24))
                                              for i in range(4)])
    reqs = []
    for i in range(4):
        params = sampled(24, seed=i, logprobs=2) if i % 2 else greedy(24)
        ids = probe[f"p{i}"]["ids"]
        reqs.append(request(f"p{i}", random_prompt(6 + i, 20 + i),
                            predicting(params, ids if i < 2 else edited(ids, i))))
    periodic = [7, 8, 9, 10] * 5  # prompt lookup has something to find
    reqs.append(request("n0", periodic, greedy(16)))
    reqs.append(request("pen", random_prompt(11, 30), greedy(12, presence_penalty=0.5)))
    overrides = dict(speculative_ngram=True, async_decode=lookahead, max_num_seqs=32)  # (rows for the drafts)
    expected = without_speculation(make_engine, reqs, **overrides)
    engine = make_engine(**overrides)
    got = outputs(engine, reqs)
    assert_same(got, expected)
    snap = engine.metrics.snapshot()
    assert snap["draft_accepted_total"] > 40 and snap["draft_tokens_total"] > snap["draft_accepted_total"], snap
    assert engine.seqs == {} and assert_pool_full(engine) is None


def test_a_stop_token_inside_an_accepted_draft_ends_the_output_there(make_engine):
    prompt = random_prompt(10, 3)
    ref = without_speculation(make_engine, [request("a", prompt, greedy(30))])["a"]["ids"]
    at = next(i for i in range(6, len(ref)) if ref[i] not in ref[:i])
    params = greedy(30, stop_token_ids=(ref[at],))
    expected = without_speculation(make_engine, [request("a", prompt, params)])
    engine = make_engine()
    got = outputs(engine, [request("a", prompt, predicting(params, ref))])
    assert_same(got, expected)
    assert got["a"]["finish"] == FINISH_STOP and got["a"]["ids"] == ref[: at + 1]
    assert engine.metrics.snapshot()["draft_accepted_total"] > 0
    assert_pool_full(engine)


def test_limits_cap_the_drafts(make_engine):
    prompt = random_prompt(12, 4)
    ref = without_speculation(make_engine, [request("a", prompt, greedy(60))], max_model_len=96)["a"]["ids"]
    for max_tokens, max_model_len in ((7, 96), (60, 40)):
        reqs = [request("a", prompt, predicting(greedy(max_tokens), ref))]
        expected = without_speculation(make_engine, reqs, max_model_len=max_model_len)
        engine = make_engine(max_model_len=max_model_len)
        got = outputs(engine, reqs)
        assert_same(got, expected)
        assert got["a"]["finish"] == FINISH_LENGTH
        assert len(got["a"]["ids"]) == min(max_tokens, max_model_len - len(prompt))
        assert engine.metrics.snapshot()["draft_accepted_total"] > 0


def test_preemption_and_a_tiny_pool_keep_the_tokens(make_engine):
    prompts = [random_prompt(n, 40 + n) for n in (5, 9, 14)]
    probe = without_speculation(make_engine, [request(f"r{i}", p, greedy(30)) for i, p in enumerate(prompts)])
    reqs = [request(f"r{i}", p, predicting(greedy(30), probe[f"r{i}"]["ids"])) for i, p in enumerate(prompts)]
    tiny = dict(max_model_len=48, num_full_pages=14, num_sliding_pages=9, max_num_batched_tokens=16)
    engine = make_engine(**tiny)
    got = outputs(engine, reqs)
    assert_same(got, probe)
    snap = engine.metrics.snapshot()
    assert snap["preemptions_total"] > 0 and snap["draft_accepted_total"] > 0, snap
    assert_pool_full(engine)


def test_who_speculates(make_engine):
    prompt = random_prompt(8, 5)
    ref = without_speculation(make_engine, [request("a", prompt, greedy(20))])["a"]["ids"]
    for overrides, params in (({}, greedy(20, frequency_penalty=0.3)),  # penalties need the drafts' history
                              ({"speculative_tokens": 0}, greedy(20)),  # off
                              ({"speculative_max_seqs": 1, "enable_prefix_caching": False},  # two run: over the limit
                               greedy(20))):
        engine = make_engine(**overrides)
        reqs = [request("a", prompt, predicting(params, ref)), request("b", prompt, predicting(params, ref))]
        got = outputs(engine, reqs)
        assert got["a"]["ids"] == got["b"]["ids"]
        assert engine.metrics.snapshot()["draft_tokens_total"] == 0, overrides


def test_deltas_and_prometheus_count_the_drafts(make_engine):
    prompt = random_prompt(8, 6)
    ref = without_speculation(make_engine, [request("a", prompt, greedy(20))])["a"]["ids"]
    engine = make_engine()
    engine.add_request(request("a", prompt, predicting(greedy(20), ref[:8] + [1, 2, 3, 4, 5])))
    last = None
    while engine.has_unfinished():
        for d in engine.step():
            last = d
    snap = engine.metrics.snapshot()
    assert last.finish_reason == FINISH_LENGTH
    assert (last.num_draft_tokens, last.num_accepted_draft_tokens) == (snap["draft_tokens_total"],
                                                                       snap["draft_accepted_total"])
    assert 0 < last.num_accepted_draft_tokens < last.num_draft_tokens
    registry = CollectorRegistry()
    registry.register(PrometheusCollector(engine.metrics))
    assert registry.get_sample_value("gptoss_engine_draft_accepted_tokens_total") == snap["draft_accepted_total"]
    assert registry.get_sample_value("gptoss_engine_draft_tokens_total") == snap["draft_tokens_total"]


def test_typed_errors():
    for bad in (-1, 17, 2.0, True):
        with pytest.raises(EngineConfigError, match="speculative_tokens"):
            EngineConfig(speculative_tokens=bad)
    with pytest.raises(EngineConfigError, match="speculative_max_seqs"):
        EngineConfig(speculative_max_seqs=0)
    with pytest.raises(EngineConfigError, match="speculative_ngram"):
        EngineConfig(speculative_ngram="yes")
    for prediction in ((1, -2), (1, 1000), (1, "2")):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(prediction=prediction).validate(1000)
        assert err.value.param == "prediction"
