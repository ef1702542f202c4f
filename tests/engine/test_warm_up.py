"""engine/warm_up.py: the requests it runs cover a prompt, a prefix-cache hit, a mixed step, drafts and the
sampler's paths; afterwards the engine is as a new one for its users: nothing in flight, no pages held, counters
at zero, and the same tokens for the same requests (the seeds of unseeded requests included)."""

from __future__ import annotations

import numpy as np
import pytest

import engine.sampler as sampler_module
from engine.request import SamplingParams
from engine.warm_up import AllButOne, warm_up
from tests.engine.engine_testlib import greedy, random_prompt, request

SAMPLER_PATHS = ("filter_logits", "_keep_sorted", "_apply_min_p", "apply_penalties", "per_token_sums",
                 "unpack_bitmask")


def _traffic(tag: str):
    return [request(f"{tag}-greedy", random_prompt(30, 1), greedy(6)),
            request(f"{tag}-sampled", random_prompt(45, 2), SamplingParams(temperature=1.0, top_p=0.95, max_tokens=6)),
            request(f"{tag}-logprobs", random_prompt(12, 3), SamplingParams(temperature=0.7, max_tokens=5, logprobs=3))]


def test_warm_up_covers_the_paths_and_leaves_a_fresh_engine(make_engine, monkeypatch):
    engine = make_engine(enable_prefix_caching=True)
    steps, calls = [], {name: 0 for name in SAMPLER_PATHS}
    record = engine.metrics.record_step
    engine.metrics.record_step = lambda p, d, *a: steps.append((p, d)) or record(p, d, *a)
    for name in SAMPLER_PATHS:  # count the sampler's optional passes
        def counted(*a, _f=getattr(sampler_module, name), _n=name, **k):
            calls[_n] += 1
            return _f(*a, **k)
        monkeypatch.setattr(sampler_module, name, counted)
    report = warm_up(engine)
    assert report["steps"] == len(steps) > 2 and report["seconds"] > 0
    assert report["prefix_hit_tokens"] >= 4 * engine.block_manager.block_size  # B reused A's whole pages
    assert report["draft_tokens"] > 0  # A's prediction was verified
    assert any(p > 1 and d > 0 for p, d in steps), steps  # a prompt chunk beside a decoding row
    assert all(calls[name] > 0 for name in SAMPLER_PATHS), calls  # sort (B) and top-k (C) paths, penalties, mask
    # afterwards: nothing in flight or held, counters at zero, gauges re-read
    assert not engine.has_unfinished()
    snap = engine.metrics.snapshot()
    assert snap["requests_added_total"] == snap["steps_total"] == snap["prefill_tokens_total"] == 0
    assert snap["ttft_seconds"]["count"] == 0 and snap["requests_finished_total"] == {}
    assert snap["draft_tokens_total"] == 0
    usage = engine.block_manager.usage()
    assert usage["full_pages_used"] == usage["sliding_pages_used"] == 0, usage
    assert usage["full_pages_cached"] > 0  # the warm-up's prompts stay cached, evictable
    assert snap["num_running"] == snap["num_waiting"] == 0 and snap["full_pages_free"] == usage["full_pages_free"]
    assert engine.block_manager.prefix_hit_tokens == engine.block_manager.prefix_query_tokens == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_tokens_are_the_same_with_and_without_a_warm_up(make_engine, prefix_caching):
    cold = make_engine(enable_prefix_caching=prefix_caching, seed=5)
    warm = make_engine(enable_prefix_caching=prefix_caching, seed=5)
    warm_up(warm)
    want = [(c.output_ids, c.logprobs) for c in cold.generate(_traffic("a"))]
    got = [(c.output_ids, c.logprobs) for c in warm.generate(_traffic("a"))]
    assert got == want  # unseeded requests draw the same seeds: the warm-up's requests bring their own


def test_short_contexts_and_busy_engines(make_engine):
    engine = make_engine(max_model_len=24)
    assert warm_up(engine)["steps"] > 0 and not engine.has_unfinished()
    engine.add_request(request("busy", random_prompt(5, 4), greedy(3)))
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(engine)


@pytest.mark.parametrize("vocab, banned", [(2048, 0), (2048, 2047), (1000, 999), (201088, 200002), (33, 32)])
def test_the_constraint_allows_every_token_but_one(vocab, banned):
    words = AllButOne(banned).start(vocab).allowed_tokens()
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")  # bit i % 32 of word i // 32 (little-endian)
    assert words.dtype == np.uint32 and len(words) == (vocab + 31) // 32
    assert bits[:vocab].sum() == vocab - 1 and bits[banned] == 0 and bits[vocab:].sum() == 0


def test_the_warm_up_probe_smoke_run(tmp_path):
    """bench/warm_up_probe.py on the CPU: a capture process, then each variant from its caches, every round run."""
    import json

    from bench import warm_up_probe

    out = tmp_path / "probe.json"
    assert warm_up_probe.main(["--tiny", "--device", "cpu", "--max-tokens", "2", "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert [r["variant"] for r in records] == ["capture", "cold", "warm-up"] and all(r["exit"] == 0 for r in records)
    assert all(len(r["rounds"]) == 2 and len(r["rounds"][0]) == len(warm_up_probe.TRAFFIC) for r in records[1:])
    assert records[2]["warm_up"]["steps"] > 0 and "warm_up" not in records[1]


def test_warm_up_over_two_ranks_changes_no_token(tmp_path):
    """TP2/EP2 over gloo with the lookahead: the warm-up's requests (a constraint among them) run on every rank,
    and the generations after it are one unwarmed process's."""
    from engine.distributed import Executor
    from engine.llm_engine import LLMEngine
    from model.loader import load_model
    from model.tiny import make_tiny
    from tests.engine.engine_testlib import run_to_end
    from tests.engine.test_parallel_engine import TINY, config, requests

    make_tiny(tmp_path, **TINY)
    single = LLMEngine(load_model(tmp_path, dtype="float32", progress=False), config())
    for r in requests():
        single.add_request(r)
    want = {rid: r["ids"] for rid, r in run_to_end(single).items()}
    executor = Executor.spawn(2)
    try:
        engine = executor.start_engine(tmp_path, config(tp_size=2, ep_size=2, async_decode=True,
                                                        enable_prefix_caching=True))
        try:
            assert warm_up(engine)["steps"] > 0
            for r in requests():
                engine.add_request(r)
            assert {rid: r["ids"] for rid, r in run_to_end(engine).items()} == want
        finally:
            engine.close()
    finally:
        executor.shutdown()
