"""Prefix caching: the page pool's reference counts, registration and LRU eviction; the engine skipping
cached prompt blocks (full-layer pages and the sliding window before the cut) and generating exactly what
it generates without the cache, whether the prefix is shared one after another, at the same time, under
eviction pressure or after preemption; and nothing is left held afterwards. Tiny fp32 model, window 8,
pages of 4 tokens."""

import json

import pytest

from engine.page_pool import KVCacheError, PagePool
from engine.request import InvalidRequestError
from tests.engine.engine_testlib import BLOCK, assert_pool_full, assert_same, greedy, random_prompt, request, run_to_end

SYSTEM = random_prompt(27, 900)  # a shared prefix: 6 whole blocks and 3 tokens


def test_pool_counts_holders_and_evicts_the_least_recently_freed_cached_page():
    pool = PagePool("full", 4)
    a, b = pool.allocate(2)
    pool.register(a, b"A")
    pool.register(b, b"B")
    pool.register(a, b"A2")  # a page keeps its first name
    assert pool.lookup(b"A") == a and pool.lookup(b"A2") is None
    assert pool.take(a) == a  # two holders now
    pool.release([a])
    assert pool.num_free == 2
    pool.release([a, b])  # a, then b become evictable: still named, counted free
    assert pool.num_free == 4 and pool.num_cached == 2 and pool.lookup(b"B") == b
    with pytest.raises(KVCacheError, match="double free"):
        pool.release([a])
    c, d = pool.allocate(2)  # the never-named pages first
    assert {c, d} & {a, b} == set() and pool.lookup(b"A") == a
    assert pool.allocate(1) == [a]  # then the least recently freed cached one, which loses its name
    assert pool.lookup(b"A") is None and pool.lookup(b"B") == b
    assert pool.take(b) == b and pool.num_free == 0


def test_pool_evicts_kept_pages_after_the_others_and_touch_refreshes_a_page():
    pool = PagePool("sliding", 5)
    pages = pool.allocate(5)
    for p, name in zip(pages, b"ABCDE"):
        pool.register(p, bytes([name]))
    a, b, c, d, e = pages
    pool.release([a, b], keep={a})  # a kept, b not
    pool.release([c, d, e])
    pool.touch(c)  # c: now the most recently freed of the others
    assert pool.num_free == 5 and pool.num_cached == 5
    assert pool.allocate(3) == [b, d, e]  # the others, least recently freed first
    assert pool.allocate(1) == [c] and pool.allocate(1) == [a]  # kept last
    assert pool.num_free == 0
    pool.release([a], keep={a})
    assert pool.lookup(b"A") is None  # (a lost its name when evicted: released unnamed, it is just free)
    assert pool.take(pool.allocate(1)[0]) == a


def prompts(n: int) -> list[list[int]]:
    return [SYSTEM + random_prompt(3 + 5 * i, 910 + i) for i in range(n)]


def generate(engine, reqs, one_by_one: bool) -> dict:
    out = {}
    if one_by_one:
        for r in reqs:
            engine.add_request(r)
            out.update(run_to_end(engine))
    else:
        for r in reqs:
            engine.add_request(r)
        out = run_to_end(engine)
    return out


@pytest.mark.parametrize("one_by_one,kv", [(True, "auto"), (False, "auto"), (True, "fp8_e4m3")])
def test_shared_prefix_generates_what_the_uncached_engine_does(make_engine, one_by_one, kv):
    reqs = [request(f"s{i}", p, greedy(7, logprobs=1)) for i, p in enumerate(prompts(4))]
    want = generate(make_engine(kv_cache_dtype=kv), reqs, one_by_one)
    engine = make_engine(enable_prefix_caching=True, kv_cache_dtype=kv)
    got = generate(engine, reqs, one_by_one)
    assert_same(got, want)
    usage = engine.block_manager.usage()
    # Each later request finds the 6 system blocks: one after another, or all at once, where requests 1-3
    # wait one step while request 0 computes the shared blocks (else request 1 would compute them too).
    assert usage["prefix_hit_tokens"] == 3 * 6 * BLOCK, usage
    assert usage["prefix_query_tokens"] == sum(len(r.prompt_ids) for r in reqs)
    assert usage["full_pages_cached"] > 0 and usage["sliding_pages_cached"] > 0
    assert_pool_full(engine)


def test_a_running_sequence_shares_its_prefix_pages(make_engine):
    """The second request arrives while the first decodes: it holds the first one's prefix pages too."""
    first, second = (request(f"c{i}", p, greedy(10)) for i, p in enumerate(prompts(2)))
    want = generate(make_engine(), [first, second], one_by_one=True)
    engine = make_engine(enable_prefix_caching=True)
    engine.add_request(first)
    got = {}

    def step() -> None:
        for d in engine.step():
            got.setdefault(d.request_id, {"ids": [], "logprobs": []})["ids"] += d.token_ids

    for _ in range(3):  # the prefill and two decode steps
        step()
    engine.add_request(second)
    step()
    a, b = (engine.seqs[r.request_id] for r in (first, second))
    assert a.full_pages.array()[:6].tolist() == b.full_pages.array()[:6].tolist()
    for rid, out in run_to_end(engine).items():
        got.setdefault(rid, {"ids": [], "logprobs": []})["ids"] += out["ids"]
    assert {rid: g["ids"] for rid, g in got.items()} == {rid: w["ids"] for rid, w in want.items()}
    assert engine.block_manager.usage()["prefix_hit_tokens"] == 6 * BLOCK
    assert_pool_full(engine)


def test_deltas_report_the_cached_prompt_tokens(make_engine):
    engine = make_engine(enable_prefix_caching=True)
    seen = {}
    for i, p in enumerate(prompts(2)):
        engine.add_request(request(f"d{i}", p, greedy(3)))
        while engine.has_unfinished():
            for d in engine.step():
                seen.setdefault(d.request_id, set()).add(d.num_cached_tokens)
    assert seen == {"d0": {0}, "d1": {6 * BLOCK}}


def test_a_cache_salt_shares_cached_blocks_only_within_its_namespace(make_engine):
    """Requests of one salt hit each other's cached prefix; of another salt (or none) they compute it again, and
    generate the same tokens either way."""
    from dataclasses import replace

    engine = make_engine(enable_prefix_caching=True)
    ids, cached = {}, {}
    p0, p1 = prompts(2)  # the same 6-block prefix, different tails
    for rid, prompt, salt in [("a0", p0, "tenant-a"), ("b0", p1, "tenant-b"), ("s0", p1, ""), ("a1", p1, "tenant-a"),
                              ("b1", p0, "tenant-b"), ("s1", p0, "")]:
        engine.add_request(replace(request(rid, prompt, greedy(3)), cache_salt=salt))
        while engine.has_unfinished():
            for d in engine.step():
                ids.setdefault(d.request_id, []).extend(d.token_ids)
                cached[d.request_id] = d.num_cached_tokens
    # the first of each namespace computes the prefix; the second finds it (only its own namespace's)
    assert cached == {"a0": 0, "b0": 0, "s0": 0, "a1": 6 * BLOCK, "b1": 6 * BLOCK, "s1": 6 * BLOCK}
    assert ids["a1"] == ids["b0"] == ids["s0"] and ids["a0"] == ids["b1"] == ids["s1"]  # same prompt, same tokens
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        engine.add_request(replace(request("bad", p0, greedy(3)), cache_salt=7))
    assert_pool_full(engine)


def test_identical_prompt_recomputes_its_last_token_only(make_engine):
    prompt = SYSTEM[:24]  # 6 whole blocks: 5 come from the cache, the last block is computed
    want = generate(make_engine(), [request("i0", prompt, greedy(5)), request("i1", prompt, greedy(5))], True)
    engine = make_engine(enable_prefix_caching=True)
    got = generate(engine, [request("i0", prompt, greedy(5)), request("i1", prompt, greedy(5))], True)
    assert {k: v["ids"] for k, v in got.items()} == {k: v["ids"] for k, v in want.items()}
    assert engine.block_manager.usage()["prefix_hit_tokens"] == 5 * BLOCK


@pytest.mark.parametrize("pages", [16, 24])
def test_eviction_and_preemption_keep_the_tokens(make_engine, pages):
    """Small pools: cached blocks are evicted to make room, sequences are preempted and recomputed (from
    the cache where it still holds their prefix); the tokens stay those of the uncached engine."""
    reqs = [request(f"e{i}", p, greedy(9)) for i, p in enumerate(prompts(5))]
    small = dict(num_full_pages=pages, num_sliding_pages=pages, max_num_batched_tokens=16, max_model_len=64)
    want = generate(make_engine(**small), reqs, one_by_one=False)
    engine = make_engine(enable_prefix_caching=True, **small)
    got = generate(engine, reqs, one_by_one=False)
    assert {k: v["ids"] for k, v in got.items()} == {k: v["ids"] for k, v in want.items()}
    assert engine.metrics.snapshot()["preemptions_total"] > 0  # (seen: 4 with 16 pages, 1 with 24)
    assert engine.block_manager.usage()["prefix_hit_tokens"] > 0
    assert_pool_full(engine)
    again = generate(engine, reqs[:1], one_by_one=True)  # whatever survived eviction serves a rerun
    assert again[reqs[0].request_id]["ids"] == want[reqs[0].request_id]["ids"]


def test_hits_reach_the_metrics_and_the_prometheus_scrape(make_engine):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from engine.metrics import PrometheusCollector

    engine = make_engine(enable_prefix_caching=True)
    reqs = [request(f"m{i}", p, greedy(3)) for i, p in enumerate(prompts(2))]
    generate(engine, reqs, one_by_one=True)
    snap = engine.metrics.snapshot()
    assert snap["prefix_hit_tokens"] == 6 * BLOCK and snap["prefix_query_tokens"] == sum(len(r.prompt_ids) for r in reqs)
    # computed prompt tokens: the second request skipped its cached blocks
    assert snap["prefill_tokens_total"] == sum(len(r.prompt_ids) for r in reqs) - 6 * BLOCK
    registry = CollectorRegistry()
    registry.register(PrometheusCollector(engine.metrics, labels={"replica": "r"}))
    text = generate_latest(registry).decode()
    sample = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    assert sample[("gptoss_engine_prefix_cache_hit_tokens_total", (("replica", "r"),))] == 6 * BLOCK
    assert sample[("gptoss_engine_kv_pages", (("pool", "full"), ("replica", "r"), ("state", "cached")))] \
        == snap["full_pages_cached"] > 0


def test_a_prefill_replica_exports_cached_prefix_kv_as_computed(make_engine):
    """A prefill-only engine: the second prompt's K/V, partly from cached pages, exports as an uncached
    engine computes it; a decode engine with the cache on continues both as one engine does."""
    reqs = [request(f"p{i}", p, greedy(5)) for i, p in enumerate(prompts(2))]

    def prefill(engine) -> dict:
        out = {}
        for r in reqs:  # one after another, so the second finds the first's blocks
            engine.add_request(r, prefill_only=True)
            run_to_end(engine, engine.step_prefill)
            out[r.request_id] = engine.export_kv(r.request_id)
        return out

    cached_engine = make_engine(enable_prefix_caching=True)
    got, want = prefill(cached_engine), prefill(make_engine())
    assert cached_engine.block_manager.usage()["prefix_hit_tokens"] == 6 * BLOCK
    assert [got[r.request_id].num_cached_tokens for r in reqs] == [0, 6 * BLOCK]  # travels for usage reports
    for rid in want:
        assert got[rid].num_cached == want[rid].num_cached and got[rid].sliding_start == want[rid].sliding_start
        for a, b in zip([*got[rid].k, *got[rid].v], [*want[rid].k, *want[rid].v]):
            assert a.shape == b.shape and (a - b).abs().max().item() < 1e-5, rid
    one = generate(make_engine(), reqs, one_by_one=True)
    decode = make_engine(enable_prefix_caching=True)
    for r in reqs:
        (delta,) = decode.import_prefilled(r, got[r.request_id])
        assert list(delta.token_ids) == one[r.request_id]["ids"][:1]
        assert delta.num_cached_tokens == got[r.request_id].num_cached_tokens
    rest = run_to_end(decode)
    assert {rid: out["ids"] for rid, out in rest.items()} == {rid: o["ids"][1:] for rid, o in one.items()}
    assert_pool_full(decode)


def test_prefix_caching_over_two_ranks(tiny_dir, make_engine):
    """TP2/EP2 over gloo: rank 0's page ids index every rank's cache, so a hit skips the prefix on every
    rank; the tokens are one process's."""
    from engine.distributed import Executor
    from tests.engine.engine_testlib import engine_config

    reqs = [request(f"t{i}", p, greedy(6)) for i, p in enumerate(prompts(3))]
    want = generate(make_engine(), reqs, one_by_one=True)
    ex = Executor.spawn(2)
    try:
        engine = ex.start_engine(tiny_dir, engine_config(enable_prefix_caching=True, tp_size=2, ep_size=2))
        got = generate(engine, reqs, one_by_one=True)
        assert engine.block_manager.usage()["prefix_hit_tokens"] == 2 * 6 * BLOCK
        engine.close()
    finally:
        ex.shutdown()
    assert {k: v["ids"] for k, v in got.items()} == {k: v["ids"] for k, v in want.items()}


def test_imported_kv_names_only_complete_sliding_blocks(make_engine):
    """An imported sequence's sliding pages start at its payload's sliding_start, so the first of them
    may be partly unwritten: only whole written blocks may serve a later local request's window."""
    # 42 cached tokens: sliding layers hold positions 35.. (window 8), in pages from block 8 (32..35). A local
    # request sharing 40 tokens cuts at 40, whose window 33..39 would read the unwritten 33 and 34.
    base = random_prompt(40, 950)
    imported = request("imp", base + [5, 6], greedy(3))
    local = request("loc", base + [8, 9, 10], greedy(6))
    prefill = make_engine()
    prefill.add_request(imported, prefill_only=True)
    run_to_end(prefill, prefill.step_prefill)
    payload = prefill.export_kv("imp")
    assert payload.sliding_start == 35  # the first sliding page is partly before sliding_start
    want = generate(make_engine(), [local], one_by_one=True)
    decode = make_engine(enable_prefix_caching=True)
    decode.import_prefilled(imported, payload)
    decode.step()  # the restore step names the imported blocks
    got = generate(decode, [local], one_by_one=True)
    assert got["loc"]["ids"] == want["loc"]["ids"]
    # Sliding block 9 (36..39) is whole, block 8 is not, so it is not named; the full pages are, but every
    # cut needs sliding block 8 or older, so nothing is reused (before the fix: a hit reading garbage).
    assert decode.block_manager.usage()["prefix_hit_tokens"] == 0


def test_prefix_cache_benchmark_smoke_run(tmp_path):
    """bench/prefix_cache.py on CPU: the cache skips shared prompt tokens and changes no token; isolated tenants
    each compute the shared prefix once."""
    from bench import prefix_cache

    out = tmp_path / "pc.json"
    assert prefix_cache.main(["--tiny", "--device", "cpu", "--tenants", "2", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    off, on, isolated, hinted = rec["runs"]
    assert rec["same_tokens"] and not off["prefix_caching"] and on["prefix_caching"] and isolated["tenants"] == 2
    assert off["sequential"]["hit_tokens"] == 0 and on["sequential"]["hit_tokens"] == 3 * 64  # 4 requests, 64 shared
    assert on["sequential"]["prefill_tokens"] == off["sequential"]["prefill_tokens"] - 3 * 64
    assert on["burst"]["hit_tokens"] > 0
    # two isolated tenants: each computes the shared prefix once (requests 0 and 1), requests 2 and 3 hit it
    assert isolated["sequential"]["hit_tokens"] == 2 * 64
    assert isolated["sequential"]["prefill_tokens"] == off["sequential"]["prefill_tokens"] - 2 * 64
    assert hinted["cut_hints"] and not isolated["cut_hints"] and hinted["tenants"] == 2
    assert hinted["sequential"]["hit_tokens"] == 2 * 64  # (the tiny run's pools keep every window anyway)


def test_same_prompts_arriving_together_compute_the_prefix_once(make_engine):
    """n completions of one prompt (or a burst on one system prompt): the first request computes the
    shared blocks, the others wait one step and take them; unrelated requests are not held back."""
    prompt = prompts(1)[0]  # 30 tokens: 7 whole blocks
    other = random_prompt(12, 77)
    reqs = [request(f"n{i}", prompt, greedy(4)) for i in range(3)] + [request("other", other, greedy(4))]
    engine = make_engine(enable_prefix_caching=True, max_num_batched_tokens=128)  # all four would fit a step
    for r in reqs:
        engine.add_request(r)
    first = engine.step()
    assert sorted(d.request_id for d in first) == ["n0", "other"]  # n1, n2 wait for n0's blocks
    out = run_to_end(engine)
    for d in first:
        out[d.request_id]["ids"] = list(d.token_ids) + out[d.request_id]["ids"]
    want = generate(make_engine(max_num_batched_tokens=128), reqs, one_by_one=False)
    assert {k: v["ids"] for k, v in out.items()} == {k: v["ids"] for k, v in want.items()}
    assert engine.block_manager.usage()["prefix_hit_tokens"] == 2 * 7 * BLOCK


def test_windows_before_likely_cuts_outlive_other_prompts_interior_windows(make_engine):
    """The sliding pool is small (a batch's windows), and every prompt's prefill frees its interior windows into
    it: with plain LRU four other prompts evicted a shared prefix's window and a conversation's last window while
    their full-layer pages stayed. Kept longer now: the window before a prompt's end (its next turn continues it)
    and before a cut some prompt was seen to be cut at (the first request that diverges after a shared system
    prompt misses, and teaches the cut; the next one hits). Tokens stay those of the uncached engine."""
    from dataclasses import replace

    small = dict(num_full_pages=1024, num_sliding_pages=48, max_num_batched_tokens=32, max_model_len=192)
    system = random_prompt(160, 930)  # 40 whole blocks
    others = [random_prompt(150, 940 + i) for i in range(9)]  # other tenants' prompts: ~38 sliding pages each
    turn1 = random_prompt(110, 960)
    reqs = []
    for i in range(3):  # a tenant's request after a shared system prompt, then three other tenants' prompts
        reqs.append(replace(request(f"sys{i}", system + random_prompt(9, 950 + i), greedy(2)), cache_salt="a"))
        if i == 0:
            reqs.append(request("turn1", turn1, greedy(3)))
        reqs += [replace(request(f"o{i}{j}", others[3 * i + j], greedy(2)), cache_salt=f"t{j}") for j in range(3)]
    reqs.append(request("turn2", turn1 + [5, 6, 7] + random_prompt(20, 970), greedy(3)))
    want = generate(make_engine(**small), reqs, one_by_one=True)
    engine = make_engine(enable_prefix_caching=True, **small)
    cached = {}
    for r in reqs:
        engine.add_request(r)
        for rid, out in run_to_end(engine).items():
            assert out["ids"] == want[rid]["ids"], rid
        cached[r.request_id] = engine.block_manager.prefix_hit_tokens - sum(cached.values())
    # sys1 diverges after the system prompt for the first time: a miss that notes the cut; sys2 hits it
    assert (cached["sys0"], cached["sys1"], cached["sys2"]) == (0, 0, 160), cached
    assert cached["turn2"] == 108, cached  # the whole blocks of turn 1's prompt (110 tokens)
    assert_pool_full(engine)


def test_a_cut_hint_keeps_the_window_before_it_from_the_first_prompt(make_engine):
    """GenerateRequest.cache_cuts (the ingress names the end of a prompt's system and developer messages): the
    window before the shared system prompt's end is kept from its first prompt on, so the first prompt that
    diverges there already hits it (without the hint it missed once, the test above). Same tokens."""
    from dataclasses import replace

    small = dict(num_full_pages=1024, num_sliding_pages=48, max_num_batched_tokens=32, max_model_len=192)
    system = random_prompt(163, 930)  # 40 whole blocks and 3 tokens: the hint is not on a block edge
    others = [random_prompt(150, 940 + i) for i in range(6)]
    reqs = []
    for i in range(2):
        reqs.append(replace(request(f"sys{i}", system + random_prompt(9, 950 + i), greedy(2)), cache_salt="a",
                            cache_cuts=(len(system),)))
        reqs += [replace(request(f"o{i}{j}", others[3 * i + j], greedy(2)), cache_salt=f"t{j}") for j in range(3)]
    want = generate(make_engine(**small), reqs, one_by_one=True)
    for hinted in (False, True):
        engine = make_engine(enable_prefix_caching=True, **small)
        cached = {}
        for r in reqs if hinted else [replace(r, cache_cuts=()) for r in reqs]:
            engine.add_request(r)
            for rid, out in run_to_end(engine).items():
                assert out["ids"] == want[rid]["ids"], rid
            cached[r.request_id] = engine.block_manager.prefix_hit_tokens - sum(cached.values())
        assert cached["sys1"] == (160 if hinted else 0), (hinted, cached)
        assert_pool_full(engine)


@pytest.mark.parametrize("cuts", [(0,), (30,), [1, 2.0], tuple(range(1, 18)), "5"])
def test_bad_cache_cuts_are_refused(make_engine, cuts):
    from dataclasses import replace

    engine = make_engine(enable_prefix_caching=True)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(replace(request("bad", random_prompt(29, 990), greedy(2)), cache_cuts=cuts))
    assert err.value.param == "cache_cuts"
    assert not engine.seqs


@pytest.mark.parametrize("extra", [1, 5])
def test_a_prompt_that_continues_an_output_starts_past_it(make_engine, extra):
    """A request's output blocks are named when it ends (their K/V computed, their tokens known): a later prompt
    that continues prompt and output (a conversation's next turn, a stream taken up by another replica) takes them,
    full-layer pages and the window before its cut (kept when the first request ended), and generates what the
    uncached engine does. 27 prompt tokens + 20 output (46 computed): the second prompt's first 11 blocks are cached,
    not only the prompt's 6."""
    first = request("o0", SYSTEM, greedy(20))
    engine = make_engine(enable_prefix_caching=True)
    out = generate(engine, [first], one_by_one=True)["o0"]["ids"]
    second = request("o1", SYSTEM + out + random_prompt(extra, 930), greedy(6))
    want = generate(make_engine(), [first, second], one_by_one=True)
    usage = engine.block_manager.usage()
    assert engine.block_manager.cached_prefix(second.prompt_ids) == (11 * BLOCK, True)  # runs into the output
    assert engine.block_manager.cached_prefix(SYSTEM + [7, 7, 7, 7, 7]) == (6 * BLOCK, False)  # only the prompt
    assert engine.block_manager.usage() == usage  # a look, nothing taken
    engine.add_request(second)
    cached, got = set(), []
    while engine.has_unfinished():
        for d in engine.step():
            cached.add(d.num_cached_tokens)
            got += d.token_ids
    assert got == want["o1"]["ids"] and want["o0"]["ids"] == out
    assert cached == {11 * BLOCK}
    assert_pool_full(engine)
