"""The prefix cache's host tier (engine/host_kv_tier.py): host slots by block hash, least recently used out; the
page copies recorded in decision order and batched only where that order cannot matter; evicted cached blocks
copied out and taken back by later prompts, generating exactly what the uncached engine generates (fp32, so
equal up to the last bits: the copies are bytes), under eviction, preemption, the lookahead and over two ranks,
with every page returned. Tiny fp32 model, window 8, pages of 4 tokens."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig, EngineConfigError
from engine.host_kv_tier import HostPool, KVMoves, host_slots_for, pack_moves, unpack_moves
from engine.sequence import Sequence, SequenceStatus
from engine.request import SamplingParams
from tests.engine.engine_testlib import (BLOCK, assert_pool_full, assert_same, engine_config, greedy, random_prompt,
                                        request, run_to_end)

SMALL = dict(num_full_pages=24, num_sliding_pages=24, max_num_batched_tokens=16, max_model_len=64)


def test_host_pool_keeps_blocks_by_hash_and_drops_the_least_recently_used_unpinned_one():
    pool = HostPool("full", 3)
    a, b, c = (pool.store(h) for h in (b"A", b"B", b"C"))
    assert [a, b, c] == [0, 1, 2] and pool.num_used == 3  # adjacent slots while free ones last
    assert pool.store(b"B") == b  # stored already: the same slot, now the most recently used
    pool.touch(a)  # least recently used first: C, B, A
    pool.pin([c])
    assert pool.store(b"D") == b and pool.lookup(b"B") is None  # C pinned: B goes
    pool.pin([a, b])
    assert pool.store(b"E") is None and pool.lookup(b"E") is None  # every slot pinned: not kept
    pool.unpin_all()
    assert pool.store(b"E") == c and pool.lookup(b"C") is None and pool.lookup(b"A") == a


def test_moves_keep_decision_order_and_batch_only_independent_copies():
    moves = KVMoves()
    moves.add("full", True, 5, 0)
    moves.add("full", True, 6, 1)
    moves.add("sliding", True, 5, 0)  # another kind: its own batches
    moves.add("full", True, 7, 0)  # slot 0 written again: a new batch, after the first
    moves.add("full", False, 7, 1)  # the other direction: a new batch
    moves.add("full", False, 8, 0)
    moves.add("full", False, 7, 2)  # page 7 written again: a new batch
    batches = moves.take()
    assert batches == [("full", True, [5, 6], [0, 1]), ("sliding", True, [5], [0]), ("full", True, [7], [0]),
                       ("full", False, [7, 8], [1, 0]), ("full", False, [7], [2])]
    assert (moves.pages_to_host, moves.pages_to_device) == (4, 3) and not moves and moves.take() == []
    assert unpack_moves(pack_moves(batches)) == batches and unpack_moves(pack_moves([])) == []


def test_slots_per_kind_come_from_the_byte_budget():
    """A sliding slot per 4 full ones: the sliding pool sends the host only the windows it keeps."""
    assert host_slots_for(0, (100, 50)) == (0, 0)
    assert host_slots_for(1000, (100, 50)) == (8, 2)  # 8 x 100 + 2 x 50 bytes
    assert host_slots_for(10_000, (100, 100)) == (80, 20)
    assert host_slots_for(1000, (0, 50)) == (0, 20)  # a model without full layers
    assert host_slots_for(1000, (100, 0)) == (10, 0)  # without sliding layers
    with pytest.raises(ValueError, match="too small for the host tier"):
        host_slots_for(449, (100, 50))  # 4 full pages, no sliding one


def seq_of(rid: str, prompt: list[int]) -> Sequence:
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=4), seed=0, arrival=0)


def cached_prompt(bm: BlockManager, length: int) -> Sequence:
    """A sequence of `length` prompt tokens computed, its whole blocks registered, then freed (cached, evictable)."""
    seq = seq_of("a", random_prompt(length, 1))
    bm.allocate(seq, length)
    seq.num_computed = length
    bm.register_blocks(seq)
    bm.free(seq)
    return seq


def test_evicted_blocks_are_copied_out_and_taken_back_into_fresh_pages():
    """Block manager alone: a prompt's blocks evicted by another's allocation are recorded as copies to host
    slots; the prompt again takes them back (recorded as copies into fresh pages) with its sliding window."""
    bm = BlockManager(BLOCK, 8, num_full_pages=6, num_sliding_pages=6, prefix_caching=True, host_slots=(8, 8))
    first = cached_prompt(bm, 17)  # 4 whole blocks, then a token
    other = seq_of("b", random_prompt(24, 2))
    bm.allocate(other, 24)  # 6 pages of each kind: 4 of them were first's cached blocks
    out = bm.take_moves()
    # full: every evicted block; sliding: only the window it kept (before the prompt's end: blocks 2 and 3)
    assert [(k, to_host, len(p)) for k, to_host, p, _ in out] == [("full", True, 4), ("sliding", True, 2)]
    bm.free(other)  # (not registered: plain free pages again)
    again = seq_of("c", first.prompt_ids)
    assert bm.take_cached_prefix(again) == 0  # nothing left on the GPU
    assert bm.extend_from_host(again, budget=16) == 4 * BLOCK and again.num_computed == 16
    back = bm.take_moves()
    # full: every block; sliding: the window before the cut (positions 9 .. 15: blocks 2 and 3)
    assert [(k, to_host, len(p)) for k, to_host, p, _ in back] == [("full", False, 4), ("sliding", False, 2)]
    slots = {k: s for k, _, _, s in out}
    assert back[0][3] == slots["full"] and back[1][3] == slots["sliding"]
    assert list(again.full_pages) == back[0][2] and list(again.sliding_pages) == back[1][2]
    assert again.sliding_first == 2 and bm.usage()["host_hit_tokens"] == 16
    # the pages are cached again under their names: a second sequence finds them on the GPU
    bm.allocate(again, 17)
    twin = seq_of("d", first.prompt_ids)
    assert bm.take_cached_prefix(twin) == 16 and bm.take_moves() == []


def test_a_model_without_full_layers_extends_by_its_sliding_window_alone():
    bm = BlockManager(BLOCK, 8, num_full_pages=0, num_sliding_pages=6, has_full=False, prefix_caching=True,
                      host_slots=(0, 8))
    first = cached_prompt(bm, 17)
    other = seq_of("b", random_prompt(24, 2))
    bm.allocate(other, 24)  # evicts all 4 cached blocks (the kept window, blocks 2 and 3, copied out)
    assert [(k, to_host, len(p)) for k, to_host, p, _ in bm.take_moves()] == [("sliding", True, 2)]
    bm.free(other)
    again = seq_of("c", first.prompt_ids)
    assert bm.take_cached_prefix(again) == 0 and bm.extend_from_host(again, budget=16) == 16
    assert [(k, to_host, len(p)) for k, to_host, p, _ in bm.take_moves()] == [("sliding", False, 2)]
    assert again.sliding_first == 2 and len(again.sliding_pages) == 2 and not again.full_pages


def test_extension_leaves_room_for_the_first_chunk():
    """Host blocks are taken back only as far as the pool keeps pages for a chunk after them."""
    bm = BlockManager(BLOCK, 8, num_full_pages=6, num_sliding_pages=6, prefix_caching=True, host_slots=(8, 8))
    first = cached_prompt(bm, 21)  # 5 whole blocks, then a token
    bm.allocate(seq_of("b", random_prompt(24, 2)), 24)  # evicts every cached block; holds all 6 pages
    bm.take_moves()
    again = seq_of("c", first.prompt_ids)
    assert bm.extend_from_host(again, budget=16) == 0  # no free page at all
    assert bm.take_moves() == [] and again.num_computed == 0 and not again.full_pages


@pytest.fixture
def host_engine(make_engine):
    def make(**overrides):
        probe = make_engine(**{k: v for k, v in overrides.items() if k != "host_pages"})
        pair = sum(probe.runner.page_bytes())
        return make_engine(enable_prefix_caching=True, host_kv_cache_bytes=overrides.pop("host_pages", 64) * pair,
                           **overrides)
    return make


def prompts(n: int, shared: int = 11) -> list[list[int]]:
    system = random_prompt(shared, 900)
    return [system + random_prompt(9 + 4 * i, 910 + i) for i in range(n)]


def one_by_one(engine, reqs) -> dict:
    out = {}
    for r in reqs:
        engine.add_request(r)
        out.update(run_to_end(engine))
    return out


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_prompts_evicted_from_the_gpu_come_back_from_the_host(make_engine, host_engine, kv):
    """Five prompts through a pool too small to keep them, then the first three again: each rerun finds its
    whole prompt cached (but the last token), from the GPU where it still holds it and from the host tier
    for the rest, and the tokens and logprobs are those of an engine without any cache."""
    reqs = [request(f"h{i}", p, greedy(6, logprobs=1)) for i, p in enumerate(prompts(5))]
    reruns = [request(f"r{i}", r.prompt_ids, greedy(6, logprobs=1)) for i, r in enumerate(reqs[:3])]
    want = one_by_one(make_engine(kv_cache_dtype=kv, **SMALL), reqs + reruns)
    gpu_only = make_engine(enable_prefix_caching=True, kv_cache_dtype=kv, **SMALL)
    one_by_one(gpu_only, reqs + reruns)
    engine = host_engine(kv_cache_dtype=kv, **SMALL)
    got = one_by_one(engine, reqs)
    before = engine.block_manager.usage()
    got.update(one_by_one(engine, reruns))
    assert_same(got, want)
    usage = engine.block_manager.usage()
    whole = sum((len(r.prompt_ids) - 1) // BLOCK * BLOCK for r in reruns)
    assert usage["prefix_hit_tokens"] - before["prefix_hit_tokens"] == whole, (before, usage)
    assert usage["host_hit_tokens"] - before["host_hit_tokens"] >= 3 * 2 * BLOCK  # each: 2 blocks past the shared 2
    assert usage["host_pages_stored"] > 0 and usage["host_pages_loaded"] > 0
    assert gpu_only.block_manager.usage()["prefix_hit_tokens"] < usage["prefix_hit_tokens"]
    assert engine.metrics.snapshot()["prefill_tokens_total"] < gpu_only.metrics.snapshot()["prefill_tokens_total"]
    assert_pool_full(engine)


def test_without_the_copies_the_tokens_change(make_engine, host_engine, monkeypatch):
    """The test above can fail: with the page copies skipped, the pages taken back hold other blocks' K/V."""
    reqs = [request(f"h{i}", p, greedy(6)) for i, p in enumerate(prompts(5))]
    reruns = [request(f"r{i}", r.prompt_ids, greedy(6)) for i, r in enumerate(reqs[:3])]
    want = one_by_one(make_engine(**SMALL), reqs + reruns)
    engine = host_engine(**SMALL)
    monkeypatch.setattr(engine.runner, "apply_kv_moves", lambda batches: None)
    got = one_by_one(engine, reqs + reruns)
    assert any(got[r.request_id]["ids"] != want[r.request_id]["ids"] for r in reruns)


@pytest.mark.parametrize("async_decode", [False, True])
def test_concurrent_requests_under_eviction_and_preemption_keep_the_tokens(make_engine, host_engine, async_decode):
    """All at once through 16 pages: blocks are evicted (copied out) and taken back while others run, and
    sequences are preempted and recomputed, with and without the lookahead; a small host tier (8 slots)
    drops blocks too."""
    reqs = [request(f"c{i}", p, greedy(9)) for i, p in enumerate(prompts(6))]
    small = dict(SMALL, num_full_pages=16, num_sliding_pages=16, async_decode=async_decode)
    want = one_by_one(make_engine(**small), reqs)
    engine = host_engine(host_pages=8, **small)
    gave_back = watch_give_backs(engine)
    for r in reqs + [request(f"again{i}", r.prompt_ids, greedy(9)) for i, r in enumerate(reqs)]:
        engine.add_request(r)
    got = run_to_end(engine)
    assert {k: got[k]["ids"] for k in want} == {k: v["ids"] for k, v in want.items()}
    assert all(got[f"again{i}"]["ids"] == want[r.request_id]["ids"] for i, r in enumerate(reqs))
    usage = engine.block_manager.usage()
    total = usage["host_full_slots_total"] + usage["host_sliding_slots_total"]
    assert usage["host_full_slots_used"] <= usage["host_full_slots_total"] and usage["host_pages_stored"] > total
    assert usage["host_hit_tokens"] > 0 and gave_back == []
    assert_pool_full(engine)


def watch_give_backs(engine) -> list[str]:
    """Requests whose host blocks were copied back and then given back unadmitted (copies for nothing: the
    extension leaves room for the first chunk, so the scheduler must admit what it extended)."""
    bm, pending, out = engine.block_manager, set(), []
    extend, free = bm.extend_from_host, bm.free

    def extend_from_host(seq, budget):
        gained = extend(seq, budget)
        if gained:
            pending.add(seq.request_id)
        return gained

    def release(seq):
        if seq.request_id in pending and seq.status is SequenceStatus.WAITING:
            out.append(seq.request_id)
        pending.discard(seq.request_id)
        free(seq)

    bm.extend_from_host, bm.free = extend_from_host, release
    return out


def test_host_tier_over_two_ranks(tiny_dir, make_engine):
    """TP2/EP2 over gloo: rank 0's moves reach every rank, each copying its own heads' pages."""
    from engine.distributed import Executor

    reqs = [request(f"t{i}", p, greedy(6)) for i, p in enumerate(prompts(5))]
    reqs += [request(f"u{i}", r.prompt_ids, greedy(6)) for i, r in enumerate(reqs[:3])]
    want = one_by_one(make_engine(**SMALL), reqs)
    pair = sum(make_engine(tp_size=1).runner.page_bytes())  # per rank: half the heads of one process
    ex = Executor.spawn(2)
    try:
        engine = ex.start_engine(tiny_dir, engine_config(enable_prefix_caching=True, tp_size=2, ep_size=2,
                                                         host_kv_cache_bytes=32 * pair, **SMALL))
        got = one_by_one(engine, reqs)
        usage = engine.block_manager.usage()
        engine.close()
    finally:
        ex.shutdown()
    assert {k: v["ids"] for k, v in got.items()} == {k: v["ids"] for k, v in want.items()}
    # per-rank pages are half the size: twice the slots of one process's 32 pairs' bytes, a quarter of them sliding
    assert usage["host_hit_tokens"] > 0 and (usage["host_full_slots_total"], usage["host_sliding_slots_total"]) \
        == host_slots_for(32 * pair, tuple(b // 2 for b in make_engine(tp_size=1).runner.page_bytes())) == (102, 25)


def test_host_tier_reaches_the_prometheus_scrape(host_engine):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from engine.metrics import PrometheusCollector

    engine = host_engine(**SMALL)
    reqs = [request(f"m{i}", p, greedy(3)) for i, p in enumerate(prompts(5))]
    one_by_one(engine, reqs + [request("m-again", reqs[0].prompt_ids, greedy(3))])
    registry = CollectorRegistry()
    registry.register(PrometheusCollector(engine.metrics, labels={"replica": "r"}))
    sample = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    usage = engine.block_manager.usage()
    assert sample[("gptoss_engine_prefix_cache_host_hit_tokens_total", (("replica", "r"),))] \
        == usage["host_hit_tokens"] > 0
    assert sample[("gptoss_engine_host_kv_pages_stored_total", (("replica", "r"),))] == usage["host_pages_stored"] > 0
    assert sample[("gptoss_engine_host_kv_slots", (("pool", "full"), ("replica", "r"), ("state", "total")))] \
        == usage["host_full_slots_total"] == 102  # 64 pairs' bytes: a sliding page per 4 full ones


def test_bad_host_tier_settings_are_config_errors(make_engine):
    with pytest.raises(EngineConfigError, match="host_kv_cache_bytes must be"):
        EngineConfig(host_kv_cache_bytes=-1)
    with pytest.raises(EngineConfigError, match="needs enable_prefix_caching"):
        EngineConfig(host_kv_cache_bytes=1 << 20, enable_prefix_caching=False)
    with pytest.raises(EngineConfigError, match="too small for the host tier"):
        make_engine(enable_prefix_caching=True, host_kv_cache_bytes=1)


def test_host_tier_benchmark_smoke_run(tmp_path):
    """bench/host_kv_tier.py on the tiny model: the GPU cache alone never hits (the round robin evicts every
    conversation before its next turn), the host tier serves the later turns, the copies round-trip, and the
    three runs generate the same tokens."""
    import json

    from bench import host_kv_tier

    out = tmp_path / "host.json"
    assert host_kv_tier.main(["--tiny", "--device", "cpu", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    off, gpu, host = record["runs"]
    assert record["same_tokens"] and host["copy"]["round_trip_exact"]
    assert gpu["hit_tokens"] == 0 and off["prefill_tokens"] == gpu["prefill_tokens"]
    assert host["host_hit_tokens"] == host["hit_tokens"] > 0
    assert host["prefill_tokens"] == off["prefill_tokens"] - host["hit_tokens"]
