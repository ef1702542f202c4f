"""Prefix-affinity routing (serve_app/prefix_router.py): the table on its own, then on a real local Ray
with two decode replicas (prefill on decode, prefix caching on): a conversation growing turn by turn is
served by the replica that holds its history, so every turn finds the previous prompt's pages cached."""

from __future__ import annotations

import random

import pytest
from ray import serve

from engine.request import GenerateRequest, SamplingParams
from serve_app.builder import DECODE_NAME, build_app
from engine.page_pool import prefix_block_hashes as prefix_hashes
from serve_app.prefix_router import PrefixTable, first_choices, near_holders, request_of
from tests.serve_app.serve_helpers import collect, growing_conversation, run_async, start_ray, stop_ray

APP = "prefix_routing"
BLOCK = 16  # the engine's page size in the served config


def test_prefix_hashes_name_equal_prefixes_alike():
    a = list(range(1000))
    b = a[:700] + [5] * 300
    ha, hb = prefix_hashes(a, 64), prefix_hashes(b, 64)
    assert len(ha) == 1000 // 64 and len(hb) == len(ha)
    assert ha[:10] == hb[:10] and all(x != y for x, y in zip(ha[10:], hb[10:]))  # 700 // 64 = 10 blocks agree
    assert prefix_hashes(a[:63], 64) == [] and prefix_hashes(a, 64, max_blocks=3) == ha[:3]
    # salts (cache_salt): each its own namespace, all blocks apart; one salt names alike within itself
    salted = [prefix_hashes(a, 64, salt=salt) for salt in ("x", "y")]
    assert not (set(salted[0]) | set(salted[1])) & set(ha) and not set(salted[0]) & set(salted[1])
    assert prefix_hashes(b, 64, salt="x")[:10] == salted[0][:10] and prefix_hashes(a, 64, salt="") == ha


def test_table_finds_the_deepest_prefix_on_a_live_replica():
    t = PrefixTable()
    base = prefix_hashes(list(range(640)), 64)  # 10 blocks
    longer = prefix_hashes(list(range(640)) + [7] * 320, 64)  # same 10, then 5 more
    t.record(base, "r1")
    t.record(longer, "r2")
    assert t.lookup(longer, {"r1", "r2"}) == (15, ["r2"])
    assert t.lookup(base, {"r1", "r2"}) == (10, ["r2", "r1"])  # both hold it; the latest first
    assert t.lookup(longer, {"r1"}) == (10, ["r1"])  # r2 gone: the deepest block r1 holds
    assert t.lookup(prefix_hashes([9] * 640, 64), {"r1", "r2"}) == (0, [])
    t.forget("r2")
    assert t.lookup(longer, {"r1", "r2"}) == (10, ["r1"])


def test_table_is_bounded_oldest_first():
    t = PrefixTable(max_entries=20)
    for i in range(10):
        t.record(prefix_hashes([i] * 64 * 4, 64), f"r{i}")  # 4 blocks each
    assert len(t) == 20
    assert t.lookup(prefix_hashes([0] * 256, 64), {"r0"}) == (0, [])  # evicted
    assert t.lookup(prefix_hashes([9] * 256, 64), {"r9"}) == (4, ["r9"])


def test_holders_busier_than_the_guard_are_passed_over():
    queues = {"a": 9, "b": 3, "c": None, "d": 5}
    assert near_holders(["a", "d", "c"], queues, imbalance=4) == ["d", "c"]  # shortest known 3: a (9) is out
    assert near_holders(["a"], queues, imbalance=6) == ["a"]
    assert near_holders(["a", "b"], {"a": None, "b": None}, imbalance=0) == ["a", "b"]  # nothing known yet


def test_first_choices_put_the_callers_node_first_while_it_is_not_much_busier():
    rng = random.Random(random.randrange(2**32))
    cands = ["a1", "a2", "b1", "b2", "b3"]  # a*: on the caller's node
    idle = dict.fromkeys(cands, 0)
    # no holder: two of the node's replicas, then the rest of two random ones
    outcome, groups = first_choices(cands, [], {"a1", "a2"}, idle, 4, rng)
    assert outcome == "same_node" and sorted(groups[0]) == ["a1", "a2"]
    assert all(r not in groups[0] for g in groups[1:] for r in g)
    # a holder on the node comes first; other nodes' holders next
    assert first_choices(cands, ["b1", "a2"], {"a1", "a2"}, idle, 4, rng)[1][:2] == [["a2"], ["b1"]]
    assert first_choices(cands, ["b1", "a2"], {"a1", "a2"}, idle, 4, rng)[0] == "affinity"
    # only another node holds the prefix: the node's replicas still come first (the K/V must travel back)
    outcome, groups = first_choices(cands, ["b1"], {"a1", "a2"}, idle, 4, rng)
    assert outcome == "same_node" and sorted(groups[0]) == ["a1", "a2"] and groups[1] == ["b1"]
    # the node's replicas more than `imbalance` busier than the least busy: routed as without locality
    busy = {"a1": 9, "a2": 7, "b1": 0, "b2": 1, "b3": None}
    outcome, groups = first_choices(cands, ["b2"], {"a1", "a2"}, busy, 4, rng)
    assert outcome == "affinity" and groups[0] == ["b2"]
    outcome, groups = first_choices(cands, [], {"a1", "a2"}, busy, 4, rng)
    assert outcome == "no_match" and len(groups) == 1 and len(groups[0]) == 2
    # one busy, one free on the node: the free one only
    assert first_choices(cands, [], {"a1", "a2"}, {**busy, "a2": 2}, 4, rng)[1][0] == ["a2"]
    # without locality (empty `local`) as before: holders near the shortest queue first
    outcome, groups = first_choices(cands, ["b3", "a1"], set(), busy, 4, rng)
    assert outcome == "affinity" and groups[0] == ["b3"]  # a1 (9) is past the guard
    assert first_choices(cands, ["a1"], set(), busy, 4, rng)[0] == "busy"


def test_request_of_finds_the_generate_request():
    class Pending:
        def __init__(self, args, kwargs):
            self.args, self.kwargs = args, kwargs

    req = GenerateRequest("x", [1, 2, 3])
    assert request_of(Pending([req, object()], {})) is req
    assert request_of(Pending([], {"request": req})) is req
    assert request_of(Pending(["abort-id"], {})) is None and request_of(None) is None


@pytest.fixture(scope="module")
def two_decode_replicas():
    start_ray()
    try:
        serve.run(build_app({"max_context": "1024", "kv_cache_memory_gib": "0.0625", "disaggregated": "false",
                             "decode.num_replicas": "2", "decode.graceful_shutdown_timeout_s": "1",
                             "enable_prefix_caching": "true", "prefix_routing": "true"}), name=APP, route_prefix="/pr")
        yield serve.get_deployment_handle(DECODE_NAME, APP)
    finally:
        stop_ray()


def test_a_growing_conversation_stays_on_the_replica_with_its_pages(two_decode_replicas):
    handle = two_decode_replicas.options(stream=True)
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    prompts = growing_conversation(rng, 150, 6)
    cached = []
    for turn, prompt in enumerate(prompts):
        request = GenerateRequest(f"turn{turn}-{seed}", prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                                                ignore_eos=True))
        deltas = run_async(collect(handle.generate.remote(request)))
        cached.append(max(d.num_cached_tokens for d in deltas))
    # Every whole page of the previous turn's prompt: only the replica that ran it holds them all (with two
    # replicas and random routing, six turns in a row would land right 1 time in 64).
    assert cached == [0] + [len(p) // BLOCK * BLOCK for p in prompts[:-1]], cached
