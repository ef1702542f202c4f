"""GPU sink attention against the pure-torch reference (fp32), on fresh random inputs of awkward sizes.

Covers the FlashInfer prefill wrapper, the Triton split-KV decode and KV write, directly and through
FlashInferAttentionBackend with AttentionBatch metadata (full and sliding page pools, shuffled page
tables, partly filled last pages, large positive and negative sinks), and decode under CUDA-graph
replay. Skips without an NVIDIA GPU.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from kernels.attention import flashinfer_ops  # noqa: E402
from kernels.attention.decode_triton import sink_decode, split_scratch  # noqa: E402
from kernels.attention.flashinfer_backend import FlashInferAttentionBackend  # noqa: E402
from kernels.attention.gpu_plan import flashinfer_page_lists  # noqa: E402
from kernels.attention.kv_cache import PagedKVCache  # noqa: E402
from kernels.attention.kv_write import write_kv  # noqa: E402
from kernels.attention.metadata import AttentionBatch, KVGroupMeta  # noqa: E402
from kernels.attention.reference import sink_attention  # noqa: E402
from kernels.attention.sliding_prefill_triton import SWEEP_CONFIGS  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
HQ, HKV, D, WINDOW = 64, 8, 64, 128
SCALE = 1.0 / math.sqrt(D)
BF16_TOL = 5e-3
LENGTHS = [1, 127, 128, 129, 1000, 33000]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_sinks(gen: torch.Generator) -> torch.Tensor:
    """Ordinary sinks plus a few that dominate (+12) or vanish (-40): a sink counted twice shows."""
    sinks = torch.randn(HQ, generator=gen, device=DEV) * 2
    sinks[::7] = 12.0
    sinks[3::11] = -40.0
    return sinks


def reference(q, keys, values, sinks, window, chunk=256):
    """sink_attention in fp32, chunked over queries so a 33k-token prefill fits in memory."""
    n, kv_len = q.shape[0], keys.shape[0]
    outs = []
    for i0 in range(0, n, chunk):
        i1 = min(n, i0 + chunk)
        end = kv_len - n + i1  # the chunk's queries are the last i1 - i0 positions of keys[:end]
        lo = max(0, end - (i1 - i0) - (window or end)) if window else 0
        outs.append(sink_attention(q[i0:i1].float(), keys[lo:end].float(), values[lo:end].float(), sinks, SCALE, window))
    return torch.cat(outs)


class PagedWorld:
    """Sequences with a prefix already cached plus `new` tokens this step, laid out in two shuffled
    page pools like the engine does: every page in the full pool; in the sliding pool only the pages
    from the first one the step's first query can see (its table starts there)."""

    def __init__(self, prefix: list[int], new: list[int], page: int, seed: int, pool: tuple[int, int] = (0, 0),
                 kv_dtype: torch.dtype = torch.bfloat16):
        self.gen = torch.Generator(device=DEV).manual_seed(seed)
        rng = random.Random(seed)
        self.page, self.prefix, self.new = page, prefix, new
        self.total = [p + n for p, n in zip(prefix, new)]
        # absolute position of each sequence's first sliding-visible token, rounded down to a page
        self.slide_from = [max(0, p - (WINDOW - 1)) // page * page for p in prefix]
        full_pages = [-(-t // page) for t in self.total]
        slide_pages = [-(-(t - s) // page) for t, s in zip(self.total, self.slide_from)]
        self.full_table, full_blocks = self._tables(rng, full_pages, pool[0])
        self.slide_table, slide_blocks = self._tables(rng, slide_pages, pool[1])
        self.cache = PagedKVCache.allocate([True, False], full_blocks, slide_blocks, page, HKV, D, kv_dtype, DEV)
        for c in self.cache.k + self.cache.v:  # stale garbage everywhere the step must not read
            c.copy_(torch.randn(c.shape, generator=self.gen, device=DEV))
        # the sequences' K/V over absolute positions (prefix + new), one tensor per sequence; values the
        # cache dtype holds exactly, so the reference reads what the kernels read
        self.keys = [torch.randn(t, HKV, D, generator=self.gen, device=DEV).to(kv_dtype).bfloat16() for t in self.total]
        self.values = [torch.randn(t, HKV, D, generator=self.gen, device=DEV).to(kv_dtype).bfloat16()
                       for t in self.total]
        for b, p in enumerate(prefix):  # prefill the cached prefix straight into the pages
            for layer, (table, start) in enumerate(((self.slide_table, self.slide_from[b]), (self.full_table, 0))):
                slots = self.slots(table, b, start, start, p)
                self.cache.k[layer].view(-1, HKV, D)[slots] = self.keys[b][start:p].to(kv_dtype)
                self.cache.v[layer].view(-1, HKV, D)[slots] = self.values[b][start:p].to(kv_dtype)

    @staticmethod
    def _tables(rng, pages, pool_size):
        pool = list(range(max(pool_size, sum(pages) + 11)))
        rng.shuffle(pool)
        table = torch.zeros(len(pages), max(pages) + 2, dtype=torch.int32)
        at = 0
        for b, n in enumerate(pages):
            table[b, :n] = torch.tensor(pool[at : at + n])
            at += n
        return table.to(DEV), len(pool)

    def slots(self, table, b, table_start, lo, hi):
        pos = torch.arange(lo, hi, device=DEV) - table_start
        return table[b, pos // self.page].long() * self.page + pos % self.page

    def batch(self) -> AttentionBatch:
        starts = [0]
        for n in self.new:
            starts.append(starts[-1] + n)

        def group(table, starts_at):
            kv_lens = [t - s for t, s in zip(self.total, starts_at)]
            slots = torch.cat([self.slots(table, b, starts_at[b], p, t)
                               for b, (p, t) in enumerate(zip(self.prefix, self.total))])
            return KVGroupMeta(block_tables=table, kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=DEV),
                               slot_mapping=slots, kv_lens_cpu=kv_lens)

        return AttentionBatch(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEV), query_lens_cpu=list(self.new),
            full=group(self.full_table, [0] * len(self.total)), sliding=group(self.slide_table, self.slide_from),
            is_decode=all(n == 1 for n in self.new))

    def new_kv(self):
        k = torch.cat([self.keys[b][p:t] for b, (p, t) in enumerate(zip(self.prefix, self.total))])
        v = torch.cat([self.values[b][p:t] for b, (p, t) in enumerate(zip(self.prefix, self.total))])
        return k, v

    def check(self, out, q, sinks, sliding):
        at = 0
        worst = 0.0
        for b, (p, t) in enumerate(zip(self.prefix, self.total)):
            n = t - p
            ref = reference(q[at : at + n], self.keys[b][:t], self.values[b][:t], sinks, WINDOW if sliding else None)
            worst = max(worst, rel_err(out[at : at + n], ref))
            at += n
        assert worst <= BF16_TOL, f"{'sliding' if sliding else 'full'} layer: worst rel err {worst:.2e}"
        return worst


def make_backend(**kwargs) -> FlashInferAttentionBackend:
    return FlashInferAttentionBackend([True, False], WINDOW, D, HQ, HKV, DEV, max_batch=64, max_kv_len=40000, **kwargs)


def run_step(world: PagedWorld, backend, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    backend.bind_cache(world.cache)
    batch = world.batch()
    backend.plan(batch)
    k, v = world.new_kv()
    sinks = random_sinks(gen)
    for layer, sliding in enumerate((True, False)):
        q = torch.randn(batch.num_tokens, HQ, D, generator=gen, device=DEV).bfloat16()
        out = backend.forward(layer, q, k, v, sinks)
        world.check(out, q, sinks, sliding)
        # the step's K/V landed in their pages (the reference above read them from `world`, not the cache)
        slots = batch.group(sliding).slot_mapping
        assert torch.equal(world.cache.k[layer].view(-1, HKV, D)[slots].to(k.dtype), k)
        assert torch.equal(world.cache.v[layer].view(-1, HKV, D)[slots].to(v.dtype), v)


@pytest.mark.parametrize("batch_size", [1, 3, 37])
def test_backend_decode_matches_reference(batch_size):
    rng = random.Random(batch_size)
    prefix = [rng.choice(LENGTHS) for _ in range(batch_size)]
    prefix[0] = 33000 if batch_size < 37 else 1000  # 37 x 33k of fp32 reference is slow, not harder
    world = PagedWorld(prefix, [1] * batch_size, page=16, seed=batch_size)
    run_step(world, make_backend(), seed=batch_size)


@pytest.mark.parametrize("sliding_prefill", ["triton", "flashinfer"])
@pytest.mark.parametrize("batch_size", [1, 3, 37])
def test_backend_prefill_matches_reference(batch_size, sliding_prefill):
    rng = random.Random(100 + batch_size)
    if batch_size == 1:
        prefix, new = [0], [33000]
    else:
        prefix = [rng.choice([0, 1, 127, 128, 129, 1000]) for _ in range(batch_size)]
        new = [rng.choice([1, 127, 128, 129, 1000]) for _ in range(batch_size)]
    world = PagedWorld(prefix, new, page=16, seed=100 + batch_size)
    run_step(world, make_backend(sliding_prefill=sliding_prefill), seed=batch_size)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("ragged", [True, False])
@pytest.mark.parametrize("defer", [True, False])
def test_full_layers_of_fresh_prompts_ragged_or_paged(ragged, kv_dtype, defer):
    """Prompts without cached prefixes: the full layers attend over the step's k / v rows through FlashInfer's
    ragged kernel (ragged_full) or over the pages; v passed as the model passes it, a strided view of the QKV
    rows. Both match the reference; a step with a cached prefix always takes the pages. defer: the ragged plan
    made at the first full layer (defer_ragged_plan) or in plan()."""
    world = PagedWorld([0, 0, 0], [129, 1000, 77], page=16, seed=21, kv_dtype=kv_dtype)
    backend = make_backend()
    backend.ragged_full = ragged
    backend.defer_ragged_plan = defer
    backend.bind_cache(world.cache)
    batch = world.batch()
    backend.plan(batch)
    assert backend.step_ragged == ragged
    assert backend.step_sliding_rows  # fresh prompts: the sliding kernel reads the step's k / v rows
    assert (backend._pending_ragged_plan is not None) == (ragged and defer)
    gen = torch.Generator(device=DEV).manual_seed(22)
    k, v = world.new_kv()
    rows = torch.empty(k.shape[0], HQ + 2 * HKV, D, device=DEV, dtype=k.dtype)  # q | k | v per token, as QKV
    rows[:, HQ + HKV:] = v
    v_view = rows[:, HQ + HKV:]
    sinks = random_sinks(gen)
    for layer, sliding in enumerate((True, False)):
        q = torch.randn(batch.num_tokens, HQ, D, generator=gen, device=DEV).bfloat16()
        world.check(backend.forward(layer, q, k, v_view, sinks), q, sinks, sliding)
    assert backend._pending_ragged_plan is None
    continued = PagedWorld([0, 300], [129, 50], page=16, seed=23, kv_dtype=kv_dtype)
    backend.bind_cache(continued.cache)
    backend.plan(continued.batch())
    assert not backend.step_ragged and not backend.step_sliding_rows


@pytest.mark.parametrize("decode,sliding_prefill", [(True, "triton"), (False, "triton"), (False, "flashinfer")])
def test_backend_over_an_fp8_cache_matches_reference(decode, sliding_prefill):
    """kv_cache_dtype fp8_e4m3: decode reads fp8 pages in the split kernel, prefill stages them as bf16
    for FlashInfer (the Triton sliding kernel reads them directly); all against the fp32 reference over
    the same (fp8-representable) K/V."""
    rng = random.Random(5)
    prefix = [rng.choice([0, 1, 127, 129, 1000, 5000]) for _ in range(5)]
    new = [1] * 5 if decode else [rng.choice([1, 128, 129, 1000]) for _ in range(5)]
    if decode:
        prefix = [max(p, 1) for p in prefix]
    world = PagedWorld(prefix, new, page=16, seed=55, kv_dtype=torch.float8_e4m3fn)
    run_step(world, make_backend(sliding_prefill=sliding_prefill), seed=56)


@pytest.mark.parametrize("config", SWEEP_CONFIGS)
@pytest.mark.parametrize("page", [16, 64])
def test_sliding_prefill_launch_shapes_match_reference(page, config):
    """Each launch shape bench/attention times, over prompts that start fresh, continue a cached prefix
    (the sliding table starting mid-sequence) or add one token."""
    prefix, new = [0, 300, 129, 5000, 40], [1000, 77, 1, 129, 3]
    world = PagedWorld(prefix, new, page=page, seed=page + config.block_m)
    run_step(world, make_backend(sliding_prefill_config=config), seed=config.block_n)


def test_backend_without_cache_matches_reference():
    gen = torch.Generator(device=DEV).manual_seed(7)
    lens = [1, 129, 1000]
    backend = make_backend()
    backend.plan(AttentionBatch.without_cache(lens, DEV))
    sinks = random_sinks(gen)
    t = sum(lens)
    q = torch.randn(t, HQ, D, generator=gen, device=DEV).bfloat16()
    k = torch.randn(t, HKV, D, generator=gen, device=DEV).bfloat16()
    v = torch.randn(t, HKV, D, generator=gen, device=DEV).bfloat16()
    for layer, window in ((0, WINDOW), (1, None)):
        out = backend.forward(layer, q, k, v, sinks)
        at = 0
        for n in lens:
            ref = reference(q[at : at + n], k[at : at + n], v[at : at + n], sinks, window)
            assert rel_err(out[at : at + n], ref) <= BF16_TOL
            at += n


def test_backend_decode_replays_in_a_cuda_graph():
    """Capture one decode step, then replay it on a different step of the same batch size."""
    backend = make_backend(cuda_graph=True)
    pool = (2300, 64)  # the same page pools for both steps, as in a running engine
    worlds = [PagedWorld([1000, 129, 33000], [1, 1, 1], 16, 11, pool), PagedWorld([5, 4000, 127], [1, 1, 1], 16, 12, pool)]
    cache = worlds[0].cache
    backend.bind_cache(cache)
    gen = torch.Generator(device=DEV).manual_seed(3)
    sinks = random_sinks(gen)
    q = [torch.randn(3, HQ, D, generator=gen, device=DEV).bfloat16() for _ in range(2)]
    k_in, v_in = torch.empty(3, HKV, D, dtype=torch.bfloat16, device=DEV), torch.empty(3, HKV, D, dtype=torch.bfloat16, device=DEV)
    q_in = torch.empty_like(q[0])
    backend.plan(worlds[0].batch())
    k_in.copy_(worlds[0].new_kv()[0]), v_in.copy_(worlds[0].new_kv()[1]), q_in.copy_(q[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernels outside the capture
        backend.forward(0, q_in, k_in, v_in, sinks), backend.forward(1, q_in, k_in, v_in, sinks)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [backend.forward(layer, q_in, k_in, v_in, sinks) for layer in range(2)]
    for step, world in enumerate(worlds):
        for mine, theirs in zip(cache.k + cache.v, world.cache.k + world.cache.v):
            mine.copy_(theirs)  # this step's prefix pages
        backend.plan(world.batch())
        k, v = world.new_kv()
        k_in.copy_(k), v_in.copy_(v), q_in.copy_(q[step])
        graph.replay()
        torch.cuda.synchronize()
        for layer, sliding in enumerate((True, False)):
            world.check(outs[layer], q[step], sinks, sliding)


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("num_splits", [1, 2, 8, 64])
@pytest.mark.parametrize("window", [None, WINDOW])
def test_sink_decode_direct(page, num_splits, window):
    seed = page * 1000 + num_splits * 10 + (window or 0)
    world = PagedWorld([0, 126, 127, 128, 1000, 33000, 16], [1] * 7, page, seed)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    batch = world.batch()
    meta = batch.group(window is not None)
    layer = 0 if window else 1
    k, v = world.new_kv()
    write_kv(k, v, world.cache.k[layer], world.cache.v[layer], meta.slot_mapping)
    q = torch.randn(7, HQ, D, generator=gen, device=DEV).bfloat16()
    sinks = random_sinks(gen)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    part_o, part_lse = split_scratch(7, HQ, num_splits, D, DEV)
    sink_decode(q, world.cache.k[layer], world.cache.v[layer], meta.block_tables, meta.kv_lens, sinks, SCALE,
                window, num_splits, out, part_o, part_lse)
    world.check(out, q, sinks, window is not None)


def test_write_kv_matches_index_copy_and_skips_padding():
    gen = torch.Generator(device=DEV).manual_seed(5)
    cache = [torch.randn(40, 16, HKV, D, generator=gen, device=DEV).bfloat16() for _ in range(2)]
    twin = [c.clone() for c in cache]
    t = 37
    slots = torch.randperm(40 * 16, generator=gen, device=DEV)[:t]
    slots[5] = -1  # padding token
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=gen, device=DEV).bfloat16()
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(t, HKV, D)  # strided views, as the model makes them
    v = qkv[:, (HQ + HKV) * D :].view(t, HKV, D)
    write_kv(k, v, cache[0], cache[1], slots)
    keep = slots >= 0
    twin[0].view(-1, HKV, D).index_copy_(0, slots[keep], k[keep])
    twin[1].view(-1, HKV, D).index_copy_(0, slots[keep], v[keep])
    assert torch.equal(cache[0], twin[0]) and torch.equal(cache[1], twin[1])


@pytest.mark.parametrize("backend", flashinfer_ops.PREFILL_BACKENDS)
@pytest.mark.parametrize("window", [None, WINDOW])
def test_flashinfer_sink_prefill_direct(backend, window):
    if backend == "fa3" and flashinfer_ops.default_prefill_backend(DEV) != "fa3":
        pytest.skip("fa3 needs sm90a")
    seed = 300 + (window or 0) + (backend == "fa3")
    world = PagedWorld([0, 129, 1000], [1000, 127, 129], 16, seed)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    batch = world.batch()
    sliding = window is not None
    meta, layer = batch.group(sliding), 0 if sliding else 1
    k, v = world.new_kv()
    write_kv(k, v, world.cache.k[layer], world.cache.v[layer], meta.slot_mapping)
    indptr, indices, last = flashinfer_page_lists(meta.block_tables, meta.kv_lens_cpu, 16)
    wrapper = flashinfer_ops.sink_prefill_wrapper(flashinfer_ops.new_workspace(DEV), (window or 0) - 1, backend, D)
    flashinfer_ops.plan_sink_prefill(wrapper, batch.query_start_loc.cpu(), indptr, indices, last, HQ, HKV, D, 16,
                                     (window or 0) - 1, SCALE)
    q = torch.randn(batch.num_tokens, HQ, D, generator=gen, device=DEV).bfloat16()
    sinks = random_sinks(gen)
    out = flashinfer_ops.run_sink_prefill(wrapper, q, world.cache.k[layer], world.cache.v[layer], sinks, SCALE)
    world.check(out, q, sinks, sliding)


@pytest.mark.parametrize("backend", ["flash", "cudnn"])
@pytest.mark.parametrize("n", [1, 129, 1000])
def test_dense_sink_prefill_matches_reference(backend, n):
    """The probe of kernels/attention/dense_prefill.py (torch SDPA + the sink rescale kernel) on a whole prompt,
    v a strided view of wider rows as the rotary kernel leaves it."""
    from kernels.attention.dense_prefill import dense_sink_prefill

    gen = torch.Generator(device=DEV).manual_seed(n)
    q = torch.randn(n, HQ, D, generator=gen, device=DEV).bfloat16()
    k = torch.randn(n, HKV, D, generator=gen, device=DEV).bfloat16()
    rows = torch.randn(n, 3 * HKV * D, generator=gen, device=DEV).bfloat16()
    v = rows[:, HKV * D:2 * HKV * D].view(n, HKV, D)
    sinks = random_sinks(gen)
    try:
        out = dense_sink_prefill(q, k, v, sinks, SCALE, backend)
    except RuntimeError as exc:  # this torch build has no such kernel for these shapes
        pytest.skip(f"torch {backend} SDPA unavailable: {str(exc).splitlines()[0][:120]}")
    assert rel_err(out, reference(q, k, v, sinks, None)) < BF16_TOL


def test_fill_decode_buffers_on_the_gpu_is_step_buffers_fill():
    """The one-launch decode plan fill against StepBuffers.fill (torch ops) over consecutive steps."""
    from kernels.attention.gpu_plan import StepBuffers
    from kernels.attention.plan_fill_triton import fill_decode_buffers

    caps = [(16, 2100, 16), (16, 12, 16)]
    ours = [StepBuffers.allocate(*c, "cuda") for c in caps]
    for b in ours:
        b.block_tables.random_(0, 1000), b.kv_lens.random_(0, 1000), b.slot_mapping.random_(0, 1000)
    twins = [StepBuffers(b.block_tables.clone(), b.kv_lens.clone(), b.slot_mapping.clone()) for b in ours]
    for n in (13, 1, 16, 5):
        metas = []
        for _, cols, _ in caps:
            lens = torch.randint(1, 30_000, (n,), dtype=torch.int32)
            metas.append(KVGroupMeta(torch.randint(0, 90_000, (n, random.randint(1, cols)), dtype=torch.int32).cuda(),
                                     lens.cuda(), torch.randint(0, 10**6, (n,)).cuda(), lens.tolist()))
        ids = torch.zeros(16, dtype=torch.int64, device="cuda")
        src = torch.randint(0, 2**40, (n,), device="cuda")
        fill_decode_buffers(list(zip(ours, metas)), n, ((src, ids),))
        assert torch.equal(ids[:n], src) and not ids[n:].any()
        for t, m in zip(twins, metas):
            t.fill(m, n)
        for o, t in zip(ours, twins):
            assert torch.equal(o.block_tables, t.block_tables) and torch.equal(o.kv_lens, t.kv_lens)
            assert torch.equal(o.slot_mapping, t.slot_mapping)
