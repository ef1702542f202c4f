"""kv_cache_dtype="fp8_e4m3" on CPU (the torch twin): pools hold 4x the pages of the fp32 tiny model's cache
in the same bytes, and a prefill/decode hand-off over a pickled fp8 payload continues exactly as one engine.
How close fp8 pages keep the logits: tests/model/test_cached_forward.py."""

import pickle

import pytest
import torch

from engine.config import EngineConfig, EngineConfigError
from kernels.attention.kv_cache import KV_CACHE_DTYPES, store_rows
from engine.config import KV_CACHE_DTYPES as CONFIG_KV_CACHE_DTYPES
from tests.engine.engine_testlib import assert_pool_full, engine_config, greedy, random_prompt, request, run_to_end


def test_config_names_match_and_bad_settings_are_refused():
    assert CONFIG_KV_CACHE_DTYPES == KV_CACHE_DTYPES
    with pytest.raises(EngineConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")
    assert EngineConfig(kv_cache_dtype="fp8_e4m3", tp_size=2, ep_size=2).world_size == 2  # any split


def test_store_rows_rounds_and_saturates_like_the_gpu_kernels():
    cache = torch.zeros(3, 4, 2, 8, dtype=torch.float8_e4m3fn)
    rows = torch.randn(2, 2, 8) * 100
    rows[0, 0, 0], rows[1, 1, 1] = 1000.0, -1e6  # beyond e4m3's 448: saturates (Triton's satfinite store)
    store_rows(cache, torch.tensor([5, 11]), rows)
    flat = cache.view(-1, 2, 8).float()
    assert torch.equal(flat[5], rows[0].to(torch.float8_e4m3fn).float())
    assert flat[5, 0, 0] == 448.0 and flat[11, 1, 1] == -448.0
    assert flat[[i for i in range(12) if i not in (5, 11)]].abs().sum() == 0


def test_pools_hold_four_times_the_pages_of_an_fp32_cache(make_engine):
    budget = 2**20
    fp32 = make_engine(num_full_pages=None, num_sliding_pages=None, kv_cache_bytes=budget)
    fp8 = make_engine(num_full_pages=None, num_sliding_pages=None, kv_cache_bytes=budget, kv_cache_dtype="fp8_e4m3")
    assert fp8.runner.kv_cache.k[0].dtype == torch.float8_e4m3fn
    full32, full8 = fp32.block_manager.usage()["full_pages_total"], fp8.block_manager.usage()["full_pages_total"]
    assert full8 >= 4 * full32 - 8, (full32, full8)


def test_fp8_hand_off_over_a_pickled_payload_equals_one_engine(make_engine):
    reqs = [request(f"h{i}", random_prompt(n, 70 + i), greedy(7)) for i, n in enumerate((3, 9, 26))]
    one = make_engine(kv_cache_dtype="fp8_e4m3")
    for r in reqs:
        one.add_request(r)
    expected = run_to_end(one)
    prefill, decode = make_engine(kv_cache_dtype="fp8_e4m3"), make_engine(kv_cache_dtype="fp8_e4m3")
    for r in reqs:
        prefill.add_request(r, prefill_only=True)
    run_to_end(prefill, prefill.step_prefill)
    for r in reqs:
        payload = prefill.export_kv(r.request_id)
        assert payload.k[0].dtype == torch.float8_e4m3fn
        payload = pickle.loads(pickle.dumps(payload))  # what a transport does to it
        assert payload.k[0].dtype == torch.float8_e4m3fn
        (delta,) = decode.import_prefilled(r, payload)
        assert list(delta.token_ids) == expected[r.request_id]["ids"][:1]
    rest = run_to_end(decode)
    for r in reqs:
        assert expected[r.request_id]["ids"][1:] == rest[r.request_id]["ids"], r.request_id
    assert_pool_full(decode)


def test_fp8_pages_over_two_ranks_equal_one_engine(tiny_dir, make_engine):
    """TP2/EP2 over gloo with float8 pages: each rank rounds its own heads' K/V, so generations equal one
    process's with float8 pages; an fp8 hand-off (moved between the ranks as bytes) imports into the
    split engine and exports from it as one engine's."""
    from engine.distributed import Executor

    reqs = [request(f"p{i}", random_prompt(n, 90 + i), greedy(6)) for i, n in enumerate((4, 13, 27))]
    one = make_engine(kv_cache_dtype="fp8_e4m3")
    for r in reqs:
        one.add_request(r, prefill_only=True)
    run_to_end(one, one.step_prefill)
    payloads = {r.request_id: one.export_kv(r.request_id) for r in reqs}
    expected = {}
    for r in reqs:  # its own K/V back: the one-engine continuation
        (delta,) = one.import_prefilled(r, payloads[r.request_id])
        expected[r.request_id] = list(delta.token_ids)
    for rid, out in run_to_end(one).items():
        expected[rid] += out["ids"]
    ex = Executor.spawn(2)
    try:
        split = ex.start_engine(tiny_dir, engine_config(kv_cache_dtype="fp8_e4m3", tp_size=2, ep_size=2))
        assert split.runner.kv_cache.k[0].dtype == torch.float8_e4m3fn
        got = {}
        for r in reqs:  # scatter: each rank receives its heads' fp8 bytes
            (delta,) = split.import_prefilled(r, pickle.loads(pickle.dumps(payloads[r.request_id])))
            got[r.request_id] = list(delta.token_ids)
        for rid, out in run_to_end(split).items():
            got[rid] += out["ids"]
        assert got == expected and all(len(ids) == 6 for ids in got.values())
        for r in reqs:  # prefill on the split engine, gather to rank 0: the one engine's pages
            split.add_request(request(f"x{r.request_id}", r.prompt_ids, greedy(1)), prefill_only=True)
        run_to_end(split, split.step_prefill)
        for r in reqs:
            mine, theirs = split.export_kv(f"x{r.request_id}"), payloads[r.request_id]
            assert mine.k[0].dtype == torch.float8_e4m3fn
            for a, b in zip([*mine.k, *mine.v], [*theirs.k, *theirs.v]):
                a, b = a.float(), b.float()
                differ = (a != b).float().mean().item()  # fp32 matmuls of other shapes may round across an fp8 step
                assert differ < 0.01 and ((a - b).abs() <= b.abs() / 8 + 2**-9).all(), (r.request_id, differ)
        split.close()
    finally:
        ex.shutdown()
