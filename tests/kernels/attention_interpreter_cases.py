"""kernels/attention Triton kernels against reference.sink_attention, on CPU tensors under Triton's
interpreter. Run by tests/kernels/test_attention_backend_cpu.py in a subprocess (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import random

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_attention_backend_cpu.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

from tests.kernels.interpreter import fresh_seed  # noqa: E402,F401  (autouse fixture)
from kernels.attention.gpu_plan import StepBuffers  # noqa: E402
from kernels.attention.metadata import KVGroupMeta  # noqa: E402
from kernels.attention.plan_fill_triton import fill_decode_buffers  # noqa: E402
from kernels.attention.reference import gather_pages, sink_attention  # noqa: E402
from kernels.attention.sliding_prefill_triton import (SlidingPrefillConfig, plan_tiles,  # noqa: E402
                                                      single_query_config, sliding_prefill)


def paged(keys: list[torch.Tensor], values: list[torch.Tensor], page: int, dtype: torch.dtype):
    """Each sequence's visible K and V [L, H, D] in shuffled pages of two pools sharing one table (plus
    spare pages of garbage), as the engine lays out a layer kind."""
    counts = [-(-kv.shape[0] // page) for kv in keys]
    order = list(range(sum(counts) + 2))
    random.shuffle(order)
    h, d = keys[0].shape[1:]
    k_pool = torch.randn(len(order), page, h, d).to(dtype)
    v_pool = torch.randn(len(order), page, h, d).to(dtype)
    tables = torch.zeros(len(keys), max(counts), dtype=torch.int32)
    used = 0
    for b, (k, v) in enumerate(zip(keys, values)):
        pages = order[used:used + counts[b]]
        used += counts[b]
        tables[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        for j, p in enumerate(pages):
            k_pool[p, :k[j * page:(j + 1) * page].shape[0]] = k[j * page:(j + 1) * page].to(dtype)
            v_pool[p, :v[j * page:(j + 1) * page].shape[0]] = v[j * page:(j + 1) * page].to(dtype)
    return k_pool, v_pool, tables


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("hq,hkv,d,window,block_m,block_n,tail_n", [
    (16, 2, 32, 9, 4, 16, 0),  # the window spans pages and tiles
    (6, 2, 16, 128, 16, 64, 0),  # GROUP 3 padded to 4
    (6, 2, 16, 128, 16, 64, 16),  # the keys past two whole steps in 16-key steps
    (8, 8, 16, 5, 16, 16, 0),  # GROUP 1
    (16, 2, 32, 1 << 20, 8, 16, 0),  # a window past every sequence: full causal (bench/attention --full-triton)
    (16, 2, 32, 1 << 20, 8, 64, 16),  # ... with several tail steps after the whole ones
])
def test_sliding_prefill_matches_twin(hq, hkv, d, window, block_m, block_n, tail_n, kv_dtype):
    page = 4
    # (visible kv length, new queries): a fresh prompt, chunks after a cached prefix, a single query,
    # a table that starts mid-sequence (only the window's pages kept)
    shapes = [(37, 37), (50, 13), (21, 1), ((window if window < 1024 else 64) + 11, 6)]
    scale = d ** -0.5
    sinks = torch.randn(hq) * 2
    sinks[0] = 9.0
    sinks[-1] = -30.0
    keys = [torch.randn(kv_len, hkv, d) for kv_len, _ in shapes]
    values = [torch.randn(kv_len, hkv, d) for kv_len, _ in shapes]
    k_pool, v_pool, tables = paged(keys, values, page, kv_dtype)
    q = (torch.randn(sum(n for _, n in shapes), hq, d)).bfloat16()
    kv_lens = torch.tensor([kv_len for kv_len, _ in shapes], dtype=torch.int32)
    config = SlidingPrefillConfig(block_m=block_m, block_n=block_n, tail_n=tail_n)
    tiles = plan_tiles([n for _, n in shapes], tables, kv_lens, block_m)
    out = torch.full_like(q, float("nan"))
    sliding_prefill(q, k_pool, v_pool, sinks, scale, window, tiles, out, config)
    row = 0
    for b, (kv_len, n) in enumerate(shapes):
        pages = tables[b, :-(-kv_len // page)].long()
        k = gather_pages(k_pool, pages, kv_len).to(torch.bfloat16)
        v = gather_pages(v_pool, pages, kv_len).to(torch.bfloat16)
        want = sink_attention(q[row:row + n].float(), k.float(), v.float(), sinks, scale, window)
        got = out[row:row + n].float()
        err = ((got - want).norm() / want.norm()).item()
        assert err < 5e-3, f"sequence {b}: relative error {err}"
        row += n


@pytest.mark.parametrize("window,tail_n", [(9, 0), (128, 16), (1 << 20, 16)])
def test_sliding_prefill_over_the_step_rows_matches_pages(window, tail_n):
    """Fresh prompts (every key one of the step's rows): kv_rows reads K from k rows and V from a strided view of
    QKV-shaped rows, as the backend passes them; the twin agrees, and the paged launch over the same keys gives
    the same values up to accumulation order."""
    hq, hkv, d, page = 6, 2, 16, 4
    lens = [37, 5, 140, 1]
    scale = d ** -0.5
    sinks = torch.randn(hq) * 2
    keys = [torch.randn(n, hkv, d).bfloat16() for n in lens]
    values = [torch.randn(n, hkv, d).bfloat16() for n in lens]
    k_pool, v_pool, tables = paged(keys, values, page, torch.bfloat16)
    k_rows = torch.cat(keys)
    qkv = torch.randn(sum(lens), hq + 2 * hkv, d).bfloat16()
    qkv[:, hq + hkv:] = torch.cat(values)
    v_rows = qkv[:, hq + hkv:]  # strided, as the rotary kernel leaves v
    q = torch.randn(sum(lens), hq, d).bfloat16()
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    config = SlidingPrefillConfig(block_m=8, block_n=32, tail_n=tail_n)
    tiles = plan_tiles(lens, tables, kv_lens, config.block_m)
    got = sliding_prefill(q, k_rows, v_rows, sinks, scale, window, tiles, torch.full_like(q, float("nan")), config,
                          kv_rows=True)
    over_pages = sliding_prefill(q, k_pool, v_pool, sinks, scale, window, tiles, torch.full_like(q, float("nan")),
                                 config)
    torch.testing.assert_close(got.float(), over_pages.float(), rtol=1e-2, atol=1e-2)
    row = 0
    for b, n in enumerate(lens):
        want = sink_attention(q[row:row + n].float(), keys[b].float(), values[b].float(), sinks, scale, window)
        err = ((got[row:row + n].float() - want).norm() / want.norm()).item()
        assert err < 5e-3, f"sequence {b}: relative error {err}"
        row += n
    with pytest.raises(ValueError, match="kv_rows"):
        sliding_prefill(q, k_rows[:-1], v_rows[:-1], sinks, scale, window, tiles, torch.empty_like(q), config,
                        kv_rows=True)


@pytest.mark.parametrize("hq,hkv", [(16, 2), (6, 2)])
def test_mixed_step_in_place_two_launches(hq, hkv):
    """A mixed step's sequences planned as two launches over the whole q and out (prompt chunks in 4-query
    tiles, one-query rows in single_query_config tiles), as the backend does: every row is written once
    and matches the twin; rows of neither launch stay untouched."""
    d, page, window = 16, 4, 9
    shapes = [(30, 1), (44, 13), (9, 1), (5, 5), (60, 1)]  # (visible kv length, new queries), interleaved
    scale = d ** -0.5
    sinks = torch.randn(hq) * 2
    keys = [torch.randn(kv_len, hkv, d) for kv_len, _ in shapes]
    values = [torch.randn(kv_len, hkv, d) for kv_len, _ in shapes]
    k_pool, v_pool, tables = paged(keys, values, page, torch.bfloat16)
    lens = [n for _, n in shapes]
    starts = [sum(lens[:b]) for b in range(len(lens))]
    q = torch.randn(sum(lens), hq, d).bfloat16()
    kv_lens = torch.tensor([kv_len for kv_len, _ in shapes], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    for seqs, config in (([1, 3], SlidingPrefillConfig(block_m=4, block_n=16)), ([0, 2, 4], single_query_config(hq // hkv))):
        pick = torch.tensor(seqs)
        tiles = plan_tiles([lens[b] for b in seqs], tables[pick], kv_lens[pick], config.block_m, [starts[b] for b in seqs])
        sliding_prefill(q, k_pool, v_pool, sinks, scale, window, tiles, out, config)
    for b, (kv_len, n) in enumerate(shapes):
        pages = tables[b, :-(-kv_len // page)].long()
        k = gather_pages(k_pool, pages, kv_len).float()
        v = gather_pages(v_pool, pages, kv_len).float()
        want = sink_attention(q[starts[b]:starts[b] + n].float(), k, v, sinks, scale, window)
        got = out[starts[b]:starts[b] + n].float()
        assert not got.isnan().any(), f"sequence {b}: rows left unwritten"
        assert ((got - want).norm() / want.norm()).item() < 5e-3, f"sequence {b}"


@pytest.mark.parametrize("n", [1, 5, 13])
def test_sink_rescale_kernel_matches_torch(n):
    """dense_prefill's rescale kernel (the GPU path) on a strided [N, H, D] view against the torch formula."""
    import triton

    from kernels.attention import dense_prefill

    h, d = 8, 16
    wide = torch.randn(n, h * d + 24)
    out = wide[:, 24:].view(n, h, d)
    lse, sinks = torch.randn(h, n) * 3, torch.randn(h) * 3
    dest = torch.empty(n, h, d)
    dense_prefill._sink_rescale_kernel[(triton.cdiv(n, 4),)](
        out, lse, sinks, dest, n, out.stride(0), out.stride(1), dest.stride(0), lse.stride(0), HEADS=h, D=d, BLOCK_T=4)
    want = out * torch.sigmoid(lse - sinks[:, None]).t()[..., None]
    torch.testing.assert_close(dest, want, atol=1e-6, rtol=1e-6)


def _step_meta(n: int, cols: int) -> KVGroupMeta:
    lens = torch.randint(1, 4096, (n,), dtype=torch.int32)
    return KVGroupMeta(block_tables=torch.randint(0, 50_000, (n, cols), dtype=torch.int32), kv_lens=lens,
                       slot_mapping=torch.randint(0, 800_000, (n,), dtype=torch.int64), kv_lens_cpu=lens.tolist())


@pytest.mark.parametrize("kinds", [1, 2])
def test_fill_decode_buffers_is_step_buffers_fill(kinds):
    """One launch for every kind equals StepBuffers.fill per kind, stale rows included, over consecutive steps of
    awkward sizes (tables wider than one inner step of columns among them)."""
    caps = [(7, 1500, 7), (9, 40, 12)][:kinds]  # (max_batch, max_blocks, max_tokens) per kind
    ours = [StepBuffers.allocate(b, c, t, "cpu") for b, c, t in caps]
    for bufs in ours:  # stale contents from an earlier step
        bufs.block_tables.random_(0, 1000)
        bufs.kv_lens.random_(0, 1000)
        bufs.slot_mapping.random_(0, 1000)
    twins = [StepBuffers(o.block_tables.clone(), o.kv_lens.clone(), o.slot_mapping.clone()) for o in ours]
    ids, positions = torch.randint(0, 99, (16,)), torch.randint(0, 99, (16,))  # the graphs' inputs: rows copied too
    for n, copies in ((7, 2), (3, 0), (1, 1), (5, 2)):
        metas = [_step_meta(n, random.randint(1, c)) for _, c, _ in caps]
        rows = [(torch.randint(0, 2**40, (2 * m,))[::2], dst) for m, dst in ((n, ids), (12, positions))][:copies]
        want_ids, want_positions = ids.clone(), positions.clone()
        for (src, _), want in zip(rows, (want_ids, want_positions)):
            want[:src.numel()] = src
        fill_decode_buffers(list(zip(ours, metas)), n, tuple(rows))
        for twin, meta in zip(twins, metas):
            twin.fill(meta, n)
        for o, t in zip(ours, twins):
            assert torch.equal(o.block_tables, t.block_tables)
            assert torch.equal(o.kv_lens, t.kv_lens) and torch.equal(o.slot_mapping, t.slot_mapping)
        assert torch.equal(ids, want_ids) and torch.equal(positions, want_positions)


def test_fill_decode_buffers_refuses_what_does_not_fit():
    bufs = StepBuffers.allocate(2, 3, 2, "cpu")
    with pytest.raises(ValueError, match="max_batch"):
        fill_decode_buffers([(bufs, _step_meta(3, 1))], 3)
    with pytest.raises(ValueError, match="sequences has"):
        fill_decode_buffers([(bufs, _step_meta(2, 1))], 1)
    with pytest.raises(ValueError, match="row copy"):  # a source longer than its destination
        fill_decode_buffers([(bufs, _step_meta(2, 1))], 2, ((torch.zeros(5, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)),))


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("window,splits,block_n", [(None, 1, 16), (None, 4, 16), (9, 1, 8), (9, 2, 8)])
def test_sink_decode_matches_twin(window, splits, block_n, early, monkeypatch):
    """The split decode kernel (one new token per sequence) against the fp32 twin, with its plan and first tile's
    page ids read before or after the PDL wait (pdl.EARLY_ATTENTION_PLAN; the interpreter runs no PDL, so this checks
    the two orders compute the same); lengths that leave splits empty and tables starting mid-sequence."""
    from kernels import pdl
    from kernels.attention.decode_triton import DecodeConfig, sink_decode, split_scratch

    monkeypatch.setattr(pdl, "EARLY_ATTENTION_PLAN", early)
    hq, hkv, d, page = 8, 2, 16, 4
    lens = [1, 5, 37, 70]
    keys = [torch.randn(n, hkv, d) for n in lens]
    values = [torch.randn(n, hkv, d) for n in lens]
    k_pool, v_pool, tables = paged(keys, values, page, torch.bfloat16)
    q = torch.randn(len(lens), hq, d).bfloat16()
    sinks = torch.randn(hq) * 2
    scale = d ** -0.5
    part_o, part_lse = split_scratch(len(lens), hq, splits, d, "cpu")
    out = torch.full_like(q, float("nan"))
    sink_decode(q, k_pool, v_pool, tables, torch.tensor(lens, dtype=torch.int32), sinks, scale, window, splits, out,
                part_o, part_lse, DecodeConfig(block_n, 4, 2))
    for b, n in enumerate(lens):
        pages = tables[b, :-(-n // page)].long()
        k = gather_pages(k_pool, pages, n).float()
        v = gather_pages(v_pool, pages, n).float()
        want = sink_attention(q[b:b + 1].float(), k, v, sinks, scale, window)
        err = ((out[b:b + 1].float() - want).norm() / want.norm()).item()
        assert err < 5e-3, f"sequence {b}: relative error {err}"
