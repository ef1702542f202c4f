"""LLMEngine end to end on the tiny model: continuous batching, chunked prefill, preemption, the
prefill/decode split, abort, stop conditions and logprobs, each against a from-scratch reference."""

import pytest
import torch

from engine.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams
from engine.scheduler import StepKind
from engine.sequence import SequenceStatus
from tests.engine.engine_testlib import (WINDOW, assert_pool_full, greedy, random_prompt, request,
                                         run_to_end)

# (prompt length, max tokens): around the window (8) and the page size (4).
SPECS = [(1, 12), (3, 7), (8, 10), (9, 5), (17, 9), (30, 6)]


def sampled(max_tokens: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=seed, max_tokens=max_tokens, **kw)


def mixed_requests():
    reqs = [request(f"g{i}", random_prompt(n, i), greedy(m)) for i, (n, m) in enumerate(SPECS)]
    reqs.append(request("s0", random_prompt(12, 50), sampled(11, seed=3)))
    reqs.append(request("s1", random_prompt(5, 51), sampled(8, seed=4, logprobs=2)))
    reqs.append(request("l0", random_prompt(10, 52), greedy(6, logprobs=3)))
    return reqs


def run_alone(make_engine, req) -> dict:
    engine = make_engine()
    engine.add_request(req)
    return run_to_end(engine)[req.request_id]


def test_concurrent_requests_equal_each_alone_and_the_reference(make_engine, reference_greedy):
    reqs = mixed_requests()
    engine = make_engine(max_num_batched_tokens=24)
    for r in reqs[:4]:
        engine.add_request(r)
    out = {}
    for _ in range(3):  # later requests join a batch that is already decoding
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    for r in reqs[4:]:
        engine.add_request(r)
    for rid, r in run_to_end(engine).items():
        out.setdefault(rid, []).extend(r["ids"])
    for r in reqs:
        alone = run_alone(make_engine, r)
        assert out[r.request_id] == alone["ids"], r.request_id
        assert len(alone["ids"]) == r.sampling.max_tokens and alone["finish"] == FINISH_LENGTH
        assert alone["deltas"] == len(alone["ids"])  # one streamed delta per token
        if r.sampling.temperature == 0:
            assert alone["ids"] == reference_greedy(r.prompt_ids, r.sampling.max_tokens), r.request_id
    assert_pool_full(engine)


def test_chunked_prefill_equals_unchunked(make_engine):
    reqs = mixed_requests()
    results = []
    for budget, seqs in ((256, 8), (5, 4)):
        engine = make_engine(max_num_batched_tokens=budget, max_num_seqs=seqs)
        for r in reqs:
            engine.add_request(r)
        results.append(run_to_end(engine))
        assert engine.metrics.snapshot()["prefill_tokens_total"] == sum(len(r.prompt_ids) for r in reqs)
    unchunked, chunked = results
    for r in reqs:
        assert chunked[r.request_id]["ids"] == unchunked[r.request_id]["ids"]
        for a, b in zip(chunked[r.request_id]["logprobs"], unchunked[r.request_id]["logprobs"]):
            assert abs(a.logprob - b.logprob) < 1e-5


def test_preemption_under_a_tiny_pool_gives_identical_outputs(make_engine):
    reqs = mixed_requests()
    big = make_engine()
    for r in reqs:
        big.add_request(r)
    expected = run_to_end(big)
    # max_model_len 48 needs 12 full pages: the pool fits one long sequence, not the batch.
    tiny = make_engine(max_model_len=48, num_full_pages=14, num_sliding_pages=6, max_num_batched_tokens=16)
    for r in reqs:
        tiny.add_request(r)
    got = run_to_end(tiny)
    assert tiny.metrics.snapshot()["preemptions_total"] > 0
    for r in reqs:
        assert got[r.request_id]["ids"] == expected[r.request_id]["ids"], r.request_id
        assert got[r.request_id]["finish"] == FINISH_LENGTH
    assert_pool_full(tiny)


def _poison(engine) -> None:
    for t in (*engine.runner.kv_cache.k, *engine.runner.kv_cache.v):
        t.fill_(float("nan"))


class _Destination:
    """A KVDestination handing out NaN-filled tensors (as a transport's slot would be), remembering them."""

    def __init__(self):
        self.given: list[torch.Tensor] = []

    def __call__(self, shapes, dtype):
        self.given = [torch.full(shape, float("nan"), dtype=dtype) for shape in shapes]
        return self.given


@pytest.mark.parametrize("export_into", [False, True])
@pytest.mark.parametrize("decode_kind", [StepKind.DECODE, StepKind.MIXED])
def test_prefill_export_then_import_equals_one_engine(make_engine, model, decode_kind, export_into):
    """export_into: the K/V is exported into tensors the caller supplies (engine/kv_payload.KVDestination)."""
    reqs = mixed_requests()
    one = make_engine()
    for r in reqs:
        one.add_request(r)
    expected = run_to_end(one)

    prefill, decode = make_engine(), make_engine()
    _poison(decode)  # every K/V the decode side reads must come from the payload or its own steps
    for r in reqs:
        prefill.add_request(r, prefill_only=True)
    first = run_to_end(prefill, prefill.step_prefill)
    payloads = {}
    for r in reqs:
        into = _Destination() if export_into else None
        payloads[r.request_id] = prefill.export_kv(r.request_id, into)
        if into is not None:  # the payload is the supplied tensors, filled
            p = payloads[r.request_id]
            assert [t.data_ptr() for t in (*p.k, *p.v)] == [t.data_ptr() for t in into.given]
            assert not any(t.isnan().any() for t in into.given)
    assert_pool_full(prefill)
    assert not prefill.seqs
    for r in reqs:
        assert first[r.request_id]["ids"] == expected[r.request_id]["ids"][:1] and first[r.request_id]["finish"] is None
        p = payloads[r.request_id]
        n = len(r.prompt_ids)
        for layer, k in enumerate(p.k):  # full layers: every token; sliding: only what stays visible
            assert k.shape[0] == (min(n, WINDOW - 1) if model.config.is_sliding(layer) else n)
    streamed = {}
    for r in reqs:
        (delta,) = decode.import_prefilled(r, payloads[r.request_id])
        streamed[r.request_id] = list(delta.token_ids)
    rest = run_to_end(decode, lambda: decode._step(decode_kind))
    for r in reqs:
        assert streamed[r.request_id] + rest[r.request_id]["ids"] == expected[r.request_id]["ids"], r.request_id
    assert_pool_full(decode)


def test_separate_prefill_and_decode_steps_on_one_engine(make_engine):
    reqs = mixed_requests()
    one = make_engine()
    for r in reqs:
        one.add_request(r)
    expected = run_to_end(one)
    engine = make_engine(max_num_batched_tokens=16, max_num_seqs=len(reqs))  # a seat for everyone
    for r in reqs:
        engine.add_request(r)
    out = {}
    while engine.scheduler.has_work(StepKind.PREFILL):
        for d in engine.step_prefill():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    assert all(len(s.output_ids) == 1 and not s.is_prefill for s in engine.seqs.values())
    assert engine.step_prefill() == []  # nothing left to prefill
    for rid, r in run_to_end(engine, engine.step_decode).items():
        out[rid] += r["ids"]
    assert out == {rid: r["ids"] for rid, r in expected.items()}


def test_import_of_an_already_finished_request(make_engine):
    prefill, decode = make_engine(), make_engine()
    r = request("one", random_prompt(6, 9), greedy(1))
    prefill.add_request(r, prefill_only=True)
    run_to_end(prefill, prefill.step_prefill)
    (delta,) = decode.import_prefilled(r, prefill.export_kv("one"))
    assert delta.finish_reason == FINISH_LENGTH and len(delta.token_ids) == 1
    assert not decode.has_unfinished()
    assert_pool_full(decode)


def test_abort_everywhere_returns_every_page(make_engine, reference_greedy):
    engine = make_engine(max_model_len=48, num_full_pages=14, num_sliding_pages=6, max_num_batched_tokens=6,
                         max_num_seqs=4)
    keep = request("keep", random_prompt(3, 1), greedy(8))
    engine.add_request(keep)
    engine.add_request(request("mid-prefill", random_prompt(30, 2), greedy(5)))
    kept = [t for d in engine.step() if d.request_id == "keep" for t in d.token_ids]
    mid = engine.seqs["mid-prefill"]
    assert mid.status is SequenceStatus.RUNNING and 0 < mid.num_computed < 30
    assert engine.abort("mid-prefill").finish_reason == FINISH_ABORT
    # Fill the pool until somebody is preempted, then abort the preempted one.
    for i in range(4):
        engine.add_request(request(f"p{i}", random_prompt(20, 10 + i), greedy(20)))
    for _ in range(200):
        kept += [t for d in engine.step() if d.request_id == "keep" for t in d.token_ids]
        preempted = [s for s in engine.seqs.values() if s.num_preemptions and s.status is SequenceStatus.WAITING]
        if preempted:
            break
    assert preempted, "the tiny pool never preempted anybody"
    delta = engine.abort(preempted[0].request_id)
    assert delta.finish_reason == FINISH_ABORT and delta.token_ids == []  # its tokens were already sent
    engine.add_request(request("waiting", random_prompt(5, 3), greedy(4)))
    assert engine.abort("waiting").finish_reason == FINISH_ABORT
    engine.add_request(request("prefilled", random_prompt(5, 4), greedy(4)), prefill_only=True)
    while engine.seqs["prefilled"].status is not SequenceStatus.PREFILLED:
        kept += [t for d in engine.step() if d.request_id == "keep" for t in d.token_ids]
    assert engine.abort("prefilled").finish_reason == FINISH_ABORT
    assert engine.abort("prefilled") is None and engine.abort("never-seen") is None
    running = [rid for rid, s in engine.seqs.items() if s.status is SequenceStatus.RUNNING and rid != "keep"]
    assert running
    for rid in running:  # decoding ones
        engine.abort(rid)
    rest = run_to_end(engine)
    kept += rest.get("keep", {"ids": []})["ids"]
    assert kept == reference_greedy(keep.prompt_ids, 8)
    for rid in list(engine.seqs):
        engine.abort(rid)
    assert not engine.seqs
    assert_pool_full(engine)


def _first_new(tokens: list[int], start: int) -> int:
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_tokens_ignore_eos_and_context_limit(make_engine, reference_greedy):
    prompt = random_prompt(9, 77)
    ref = reference_greedy(prompt, 12)
    i = _first_new(ref, 2)
    engine = make_engine()
    engine.add_request(request("stop", prompt, greedy(12, stop_token_ids=(ref[i],))))
    engine.add_request(request("ignore", prompt, greedy(12, stop_token_ids=(ref[i],), ignore_eos=True)))
    engine.add_request(request("ctx", random_prompt(90, 78), greedy(20)))  # max_model_len is 96
    out = run_to_end(engine)
    assert out["stop"] == {**out["stop"], "ids": ref[: i + 1], "finish": FINISH_STOP}  # stop token included
    assert out["ignore"]["ids"] == ref and out["ignore"]["finish"] == FINISH_LENGTH
    assert len(out["ctx"]["ids"]) == 96 - 90 and out["ctx"]["finish"] == FINISH_LENGTH


def test_logprobs_match_the_reference_distribution(make_engine, model):
    prompt = random_prompt(11, 5)
    engine = make_engine()
    engine.add_request(request("lp", prompt, greedy(5, logprobs=4)))
    out = run_to_end(engine)["lp"]
    ids = prompt + out["ids"]
    ref = torch.log_softmax(model.full_logits(ids[:-1])[len(prompt) - 1:], dim=-1)
    for step, lp in enumerate(out["logprobs"]):
        assert lp.token_id == out["ids"][step]
        assert abs(lp.logprob - ref[step, lp.token_id].item()) < 1e-5
        top = ref[step].topk(4)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert max(abs(a - b) for (_, a), b in zip(lp.top, top.values.tolist())) < 1e-5


def test_seeded_sampling_reproducible_and_seed_dependent(make_engine):
    prompt = random_prompt(6, 8)
    runs = []
    for seed in (5, 5, 6):
        runs.append(run_alone(make_engine, request("s", prompt, SamplingParams(temperature=1.5, seed=seed,
                                                                               max_tokens=16)))["ids"])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    # Without a seed the engine draws one from its own config seed: two engines agree.
    a = run_alone(make_engine, request("u", prompt, SamplingParams(temperature=1.5, max_tokens=16)))["ids"]
    b = run_alone(make_engine, request("u", prompt, SamplingParams(temperature=1.5, max_tokens=16)))["ids"]
    assert a == b
