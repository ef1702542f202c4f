"""Sink attention on the GPU: decode (our Triton split-KV kernel beside FlashInfer) and prefill.

    python -m bench.attention [--sweep] [--quick] [--out bench/results/attention_h200.json]

Decode, batch 1/8/64/256 x context 1k/8k/32k, GQA 64/8, head_dim 64, bf16 pages of 16 tokens in
shuffled order, one new token per sequence: microseconds (median of triton.testing.do_bench, which
flushes L2 before every call) and achieved KV bandwidth, for
  triton      our kernel at the split count the backend picks (gpu_plan.decode_num_splits), launched
              from Python (includes ~tens of us of host launch cost at small sizes)
  triton_graph  the same launches replayed from a CUDA graph, as the engine runs decode; one replay
              walks enough disjoint copies of the batch (>= 256 MB) that L2 cannot serve them
  fi_sink     FlashInfer's BatchAttentionWithAttentionSinkWrapper used for decode (fa3 on sm90)
  fi_decode   FlashInfer's BatchDecodeWithPagedKVCacheWrapper, no sinks (CUDA-core decode kernel)
  fi_decode_tc  the same wrapper with use_tensor_cores=True (its fa2 prefill kernel), no sinks
plus the sliding-window layer (a 128-token table, as the engine keeps it) for triton and fi_sink. Prefill: one sequence of 1k/4k/8k/32k
tokens through the sink wrapper, full causal and sliding, in TFLOP/s, and the sliding layer through our
Triton kernel (kernels/attention/sliding_prefill_triton.py) at a few launch shapes (`triton bm/bn/warps/stages`);
`--prefill-only` skips decode. Every implementation's output
is checked against kernels/attention/reference.py (fp32) before it is timed. `--sweep` times the
decode kernel's launch shapes at the policy's split count and its neighbour (graph-timed, five
shapes): how default_decode_config was chosen; `--sweep-only 1x8192,4x8192` only that sweep at those
(batch x context) points, over split counts policy/4 .. policy*2. `--prefill-lens 4096,8192` picks the prompt
lengths; `--full-triton` also runs the full causal layers through our Triton paged kernel (a probe: fa3 was
1.7-1.8x faster, kernels/attention/NOTES.md).

Notes (bytes and FLOPs first). Decode reads every visible K and V byte once:
  bytes = B * ctx * 8 kv heads * 64 dim * 2 (K, V) * 2 B = B * ctx * 2048 B
  batch 64 x ctx 8k = 1.07 GB per layer call -> 0.25 ms at the ~4.3 TB/s copy ceiling (H200,
  measured in the same run as `copy_gbps`); batch 1 x 1k = 2 MB -> ~0.5 us: launch-bound.
  FLOPs are 2 * 2 * 64 * 64 = 16 kFLOP per token-head pair for 8 query heads: 8 FLOP/B, far below
  the ~200 FLOP/B ridge, so decode is purely bandwidth-bound.
Prefill (causal, one sequence of N): 4 * Hq * D * N(N+1)/2 FLOPs = 8.8 TFLOP at 32k -> ~13 ms at
  the measured ~690 TFLOP/s bf16 GEMM rate; sliding layers do 4 * Hq * D * 128 * N.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from kernels.attention import flashinfer_ops
from kernels.attention.dense_prefill import causal_attention_lse, dense_sink_prefill, sink_rescale
from kernels.attention.decode_triton import DecodeConfig, default_decode_config, sink_decode, split_scratch
from kernels.attention.gpu_plan import decode_num_splits, flashinfer_page_lists
from kernels.attention.reference import gather_pages, sink_attention
from kernels.attention.sliding_prefill_triton import SWEEP_CONFIGS, SlidingPrefillConfig, plan_tiles, sliding_prefill

HQ, HKV, D, PAGE, WINDOW = 64, 8, 64, 16, 128
SCALE = 1.0 / math.sqrt(D)
BATCHES = [1, 8, 64, 256]
CONTEXTS = [1024, 8192, 32768]
DEV = torch.device("cuda")


def timed(fn) -> float:
    """Median microseconds."""
    return do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def rel_err(out, ref) -> float:
    return float(((out.float() - ref.float()).norm() / ref.float().norm()).item())


class DecodeShape:
    """B sequences of `ctx` tokens in a shuffled pool of pages, with q and sinks for one step."""

    def __init__(self, pool_k, pool_v, batch: int, ctx: int, gen: torch.Generator):
        self.batch, self.ctx = batch, ctx
        pages = ctx // PAGE
        perm = torch.randperm(pool_k.shape[0], generator=gen, device=DEV)[: batch * pages]
        self.k, self.v = pool_k, pool_v
        self.tables = perm.view(batch, pages).to(torch.int32)
        self.kv_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        self.q = torch.randn(batch, HQ, D, generator=gen, device=DEV).bfloat16()
        self.sinks = torch.randn(HQ, generator=gen, device=DEV) * 2
        self.kv_bytes = batch * ctx * HKV * D * 2 * 2

    def reference(self, b: int, window: int | None, sinks: torch.Tensor) -> torch.Tensor:
        pages = self.tables[b].long()
        keys, values = gather_pages(self.k, pages, self.ctx), gather_pages(self.v, pages, self.ctx)
        return sink_attention(self.q[b : b + 1], keys, values, sinks, SCALE, window)

    def check(self, out: torch.Tensor, window: int | None, sinks: torch.Tensor) -> float:
        return max(rel_err(out[b : b + 1], self.reference(b, window, sinks)) for b in {0, self.batch - 1})


def bench_triton(shape: DecodeShape, window, splits: int, config: DecodeConfig | None):
    out = torch.empty_like(shape.q)
    part_o, part_lse = split_scratch(shape.batch, HQ, splits, D, DEV)

    def run():
        sink_decode(shape.q, shape.k, shape.v, shape.tables, shape.kv_lens, shape.sinks, SCALE, window, splits,
                    out, part_o, part_lse, config)

    run()
    err = shape.check(out, window, shape.sinks)
    return timed(run), err


def bench_triton_graph(shape: DecodeShape, window, splits: int, config: DecodeConfig | None, gen):
    """Median us per launch group, replayed from a CUDA graph over rotating disjoint page sets."""
    ctx = min(shape.ctx, window) if window else shape.ctx
    pages = -(-ctx // PAGE)
    step_bytes = shape.batch * ctx * HKV * D * 2 * 2
    copies = max(1, min(shape.k.shape[0] // (shape.batch * pages), -(-256 * 2**20 // step_bytes)))
    perm = torch.randperm(shape.k.shape[0], generator=gen, device=DEV)[: copies * shape.batch * pages]
    tables = perm.to(torch.int32).view(copies, shape.batch, pages)
    kv_lens = torch.full((shape.batch,), ctx, dtype=torch.int32, device=DEV)
    out = torch.empty_like(shape.q)
    part_o, part_lse = split_scratch(shape.batch, HQ, splits, D, DEV)

    def launch(table):
        sink_decode(shape.q, shape.k, shape.v, table, kv_lens, shape.sinks, SCALE, window, splits, out, part_o,
                    part_lse, config)

    launch(tables[-1])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for table in tables:
            launch(table)
    graph.replay()
    torch.cuda.synchronize()
    # the last copy's output is what `out` holds: check it against fp32
    keys = gather_pages(shape.k, tables[-1][0].long(), ctx)
    values = gather_pages(shape.v, tables[-1][0].long(), ctx)
    err = rel_err(out[:1], sink_attention(shape.q[:1], keys, values, shape.sinks, SCALE, window))
    us = timed(graph.replay) / copies
    del graph
    return us, err, step_bytes


def flashinfer_lists(shape: DecodeShape, window):
    lens = [min(shape.ctx, window)] * shape.batch if window else [shape.ctx] * shape.batch
    tables = shape.tables
    if window:  # the sliding table starts at the first live page; here the last 128 tokens = 8 pages
        tables = tables[:, -(window // PAGE):].contiguous()
    return flashinfer_page_lists(tables, lens, PAGE)


def bench_fi_sink(shape: DecodeShape, window, workspace, backend: str):
    wrapper = flashinfer_ops.sink_prefill_wrapper(workspace, (window or 0) - 1, backend, D)
    indptr, indices, last = flashinfer_lists(shape, window)
    qo = torch.arange(shape.batch + 1, dtype=torch.int32)
    flashinfer_ops.plan_sink_prefill(wrapper, qo, indptr, indices, last, HQ, HKV, D, PAGE, (window or 0) - 1, SCALE)
    out = torch.empty_like(shape.q)

    def run():
        flashinfer_ops.run_sink_prefill(wrapper, shape.q, shape.k, shape.v, shape.sinks, SCALE, out)

    run()
    err = shape.check(out, window, shape.sinks)
    return timed(run), err


def bench_fi_decode(shape: DecodeShape, workspace, tensor_cores: bool = False):
    wrapper = flashinfer_ops.decode_wrapper(workspace, tensor_cores)
    indptr, indices, last = flashinfer_lists(shape, None)
    flashinfer_ops.plan_decode(wrapper, indptr.to(DEV), indices, last.to(DEV), HQ, HKV, D, PAGE, SCALE)
    out = torch.empty_like(shape.q)

    def run():
        flashinfer_ops.run_decode(wrapper, shape.q, shape.k, shape.v, out)

    run()
    no_sink = torch.full((HQ,), -float("inf"), device=DEV)
    err = shape.check(out, None, no_sink)
    return timed(run), err


def copy_gbps() -> float:
    src = torch.randn(2**30 // 2, device=DEV, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (timed(lambda: dst.copy_(src)) * 1e-6) / 1e9


def run_decode(args, gen, workspace, fi_backend, results):
    batches = [1, 64] if args.quick else BATCHES
    contexts = [8192] if args.quick else CONTEXTS
    for ctx in contexts:
        blocks = max(batches) * ctx // PAGE + 64
        pool_k = torch.randn(blocks, PAGE, HKV, D, generator=gen, device=DEV).bfloat16()
        pool_v = torch.randn(blocks, PAGE, HKV, D, generator=gen, device=DEV).bfloat16()
        for batch in batches:
            shape = DecodeShape(pool_k, pool_v, batch, ctx, gen)
            splits = decode_num_splits(batch, ctx, HKV, torch.cuda.get_device_properties(DEV).multi_processor_count)
            row = {"batch": batch, "ctx": ctx, "kv_bytes": shape.kv_bytes, "splits": splits}
            for name, fn in (
                ("triton", lambda: bench_triton(shape, None, splits, None)),
                ("fi_sink", lambda: bench_fi_sink(shape, None, workspace, fi_backend)),
                ("fi_decode", lambda: bench_fi_decode(shape, workspace)),
                ("fi_decode_tc", lambda: bench_fi_decode(shape, workspace, tensor_cores=True)),
                ("triton_swa", lambda: bench_triton(shape, WINDOW, 1, None)),
                ("fi_sink_swa", lambda: bench_fi_sink(shape, WINDOW, workspace, fi_backend)),
            ):
                us, err = fn()
                row[f"{name}_us"], row[f"{name}_err"] = us, err
                if not name.endswith("swa"):
                    row[f"{name}_gbps"] = shape.kv_bytes / (us * 1e-6) / 1e9
            for name, window in (("triton_graph", None), ("triton_graph_swa", WINDOW)):
                us, err, step_bytes = bench_triton_graph(shape, window, 1 if window else splits, None, gen)
                row[f"{name}_us"], row[f"{name}_err"] = us, err
                row[f"{name}_gbps"] = step_bytes / (us * 1e-6) / 1e9
            results["decode"].append(row)
            print(f"decode B={batch:<3} ctx={ctx:<6} " + " ".join(
                f"{n}={row[n + '_us']:.1f}us" for n in ("triton", "triton_graph", "fi_sink", "fi_decode", "fi_decode_tc",
                                                       "triton_graph_swa")), flush=True)
        del pool_k, pool_v
        torch.cuda.empty_cache()


def run_sweep(gen, results, only: list[tuple[int, int]] | None = None):
    """Launch shapes x split counts of the full-layer decode kernel, graph-replayed. `only`: these (batch, ctx)
    points, at every power-of-two split count from policy / 4 to policy * 2."""
    num_sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    configs = [DecodeConfig(64, 4, 2), DecodeConfig(128, 4, 2), DecodeConfig(64, 4, 3), DecodeConfig(128, 4, 3),
               DecodeConfig(64, 8, 3)]
    shapes = {(64, 8192): configs, (256, 8192): configs, (256, 32768): configs, (8, 32768): configs,
              (1, 32768): configs}
    if only:
        shapes = {point: configs[:4] for point in only}
    for (batch, ctx), shape_configs in shapes.items():
        step_bytes = batch * ctx * HKV * D * 2 * 2
        copies = min(128, -(-256 * 2**20 // step_bytes))  # room for the graph's rotating copies
        blocks = batch * (ctx // PAGE) * copies + 64
        pool_k = torch.randn(blocks, PAGE, HKV, D, generator=gen, device=DEV).bfloat16()
        pool_v = torch.randn(blocks, PAGE, HKV, D, generator=gen, device=DEV).bfloat16()
        shape = DecodeShape(pool_k, pool_v, batch, ctx, gen)
        policy = decode_num_splits(batch, ctx, HKV, num_sms)
        other = policy // 2 if policy > 1 else 2  # each config at a neighbouring split count too
        counts = sorted({max(1, policy // 4), max(1, policy // 2), policy, min(64, policy * 2)}) if only \
            else (policy, other)
        trials = [(c, s) for c in shape_configs for s in counts]
        for config, splits in trials:
            us, err, step_bytes = bench_triton_graph(shape, None, splits, config, gen)
            results["sweep"].append({"batch": batch, "ctx": ctx, "block_n": config.block_n, "num_warps": config.num_warps,
                                     "num_stages": config.num_stages, "splits": splits, "policy": splits == policy,
                                     "graph_us": us, "gbps": step_bytes / (us * 1e-6) / 1e9, "err": err})
        mine = [r for r in results["sweep"] if r["batch"] == batch and r["ctx"] == ctx]
        best = max(mine, key=lambda r: r["gbps"])
        at_policy = max((r for r in mine if r["policy"]), key=lambda r: r["gbps"])
        print(f"sweep B={batch} ctx={ctx}: policy splits={policy} {at_policy['graph_us']:.1f}us; best {best}", flush=True)
        del pool_k, pool_v
        torch.cuda.empty_cache()


def prefill_flops(n: int, window: int | None) -> float:
    pairs = sum(min(i + 1, window) for i in range(n)) if window else n * (n + 1) / 2
    return 4 * HQ * D * pairs


def run_prefill(args, gen, workspace, backends, results):
    lens = [int(v) for v in args.prefill_lens.split(",")] if args.prefill_lens else \
        [1024, 8192] if args.quick else [1024, 4096, 8192, 32768]
    for n in lens:
        pages = -(-n // PAGE)
        k = torch.randn(pages + 8, PAGE, HKV, D, generator=gen, device=DEV).bfloat16()
        v = torch.randn(pages + 8, PAGE, HKV, D, generator=gen, device=DEV).bfloat16()
        table = torch.randperm(pages + 8, generator=gen, device=DEV)[:pages].to(torch.int32).view(1, pages)
        q = torch.randn(n, HQ, D, generator=gen, device=DEV).bfloat16()
        sinks = torch.randn(HQ, generator=gen, device=DEV) * 2
        indptr, indices, last = flashinfer_page_lists(table, [n], PAGE)
        qo = torch.tensor([0, n], dtype=torch.int32)
        keys, values = gather_pages(k, table[0].long(), n), gather_pages(v, table[0].long(), n)
        for backend in backends:
            for window in (None, WINDOW):
                wrapper = flashinfer_ops.sink_prefill_wrapper(workspace, (window or 0) - 1, backend, D)
                flashinfer_ops.plan_sink_prefill(wrapper, qo, indptr, indices, last, HQ, HKV, D, PAGE, (window or 0) - 1, SCALE)
                out = torch.empty_like(q)

                def run():
                    flashinfer_ops.run_sink_prefill(wrapper, q, k, v, sinks, SCALE, out)

                run()
                tail = 256  # the last queries see the most keys: check them against fp32
                ref = sink_attention(q[-tail:], keys, values, sinks, SCALE, window)
                err = rel_err(out[-tail:], ref)
                us = timed(run)
                tflops = prefill_flops(n, window) / (us * 1e-6) / 1e12
                results["prefill"].append({"backend": backend, "tokens": n, "window": window, "us": us,
                                           "tflops": tflops, "err": err})
                print(f"prefill {backend} N={n} window={window}: {us:.0f}us {tflops:.1f} TFLOP/s err {err:.1e}", flush=True)
        if args.ragged:
            run_ragged(n, q, keys, values, sinks, workspace, backends, results)
        run_sliding_triton(n, q, k, v, table, sinks, keys, values, results)
        if args.dense:
            run_dense(n, q, keys, values, sinks, results)
        if args.full_triton:
            run_sliding_triton(n, q, k, v, table, sinks, keys, values, results, window=None)


FULL_CONFIGS = [SlidingPrefillConfig(16, 64, 8, 3), SlidingPrefillConfig(16, 128, 8, 3), SlidingPrefillConfig(16, 64, 4, 3),
                SlidingPrefillConfig(32, 64, 8, 3), SlidingPrefillConfig(8, 128, 4, 3)]


def run_sliding_triton(n, q, k, v, table, sinks, keys, values, results, window: int | None = WINDOW):
    """One n-token prompt through our Triton paged kernel (the full table visible) at its launch shapes: the
    sliding layer (window 128), or with window None a full causal layer, the kernel given a window past the
    prompt (a probe of whether it can beat FlashInfer's fa3 sink prefill on the full layers)."""
    lens = torch.tensor([n], dtype=torch.int32, device=DEV)
    tail = 256
    ref = sink_attention(q[-tail:], keys, values, sinks, SCALE, window)
    # K/V sources of the sliding layer: bf16 pages, fp8 pages (read up to bf16; the reference then sees the fp8
    # values), the step's own rows (kv_rows: K contiguous, V a strided view as in the QKV output)
    qkv = torch.empty(n, HQ + 2 * HKV, D, device=DEV, dtype=torch.bfloat16)
    qkv[:, HQ + HKV:] = values
    sources = {"pages": (k, v, False, ref), "rows": (keys.contiguous(), qkv[:, HQ + HKV:], True, ref)}
    if window:
        k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        ref8 = sink_attention(q[-tail:], gather_pages(k8, table[0].long(), n).to(q.dtype),
                              gather_pages(v8, table[0].long(), n).to(q.dtype), sinks, SCALE, window)
        sources["fp8 pages"] = (k8, v8, False, ref8)
    for config in SWEEP_CONFIGS if window else FULL_CONFIGS:
        tiles = plan_tiles([n], table, lens, config.block_m)
        out = torch.empty_like(q)
        for source, (k_src, v_src, rows, want) in sources.items():
            if source != "pages" and config not in SWEEP_CONFIGS[:3]:
                continue  # the other sources at the leading shapes only

            def run():
                sliding_prefill(q, k_src, v_src, sinks, SCALE, window or 1 << 20, tiles, out, config, kv_rows=rows)

            run()
            err = rel_err(out[-tail:], want)
            us = timed(run)
            name = (f"triton{'' if window else ' full'} {config.block_m}/{config.block_n}/{config.num_warps}/"
                    f"{config.num_stages}{f' tail {config.tail_n}' if config.tail_n else ''}"
                    f"{'' if source == 'pages' else ', ' + source}")
            moved = 2 * q.numel() * q.element_size() + 2 * n * HKV * D * 2  # q + out, K + V once
            tflops = prefill_flops(n, window) / (us * 1e-6) / 1e12
            results["prefill"].append({"backend": name, "tokens": n, "window": window, "us": us, "err": err,
                                       "tflops": tflops, "gbps": moved / (us * 1e-6) / 1e9, "source": source,
                                       "config": config.__dict__})
            print(f"prefill {name} N={n} window={window}: {us:.1f}us {tflops:.1f} TFLOP/s {moved / us / 1e3:.0f} "
                  f"GB/s err {err:.1e}", flush=True)


def run_ragged(n, q, keys, values, sinks, workspace, backends, results):
    """The full causal layer of a whole prompt through FlashInfer's ragged wrapper on the sink module: K/V as
    contiguous rows (no page table), as a fresh prompt's K/V leave the QKV projection, against the paged
    sink prefill above on the same inputs."""
    tail = 256
    ref = sink_attention(q[-tail:], keys, values, sinks, SCALE, None)
    indptr = torch.tensor([0, n], dtype=torch.int32)
    k, v = keys.contiguous(), values.contiguous()
    for backend in backends:
        name = f"{backend}-ragged"
        try:
            wrapper = flashinfer_ops.sink_prefill_ragged_wrapper(workspace, -1, backend, D)
            flashinfer_ops.plan_sink_prefill_ragged(wrapper, indptr, indptr, HQ, HKV, D, -1, SCALE)
            out = torch.empty_like(q)
            flashinfer_ops.run_sink_prefill_ragged(wrapper, q, k, v, sinks, SCALE, out)
        except Exception as exc:  # a module or entry point this build lacks: report, go on
            print(f"prefill {name} N={n}: unavailable ({type(exc).__name__}: {str(exc)[:300]})", flush=True)
            results["prefill"].append({"backend": name, "tokens": n, "window": None, "error": str(exc)[:500]})
            continue
        err = rel_err(out[-tail:], ref)
        us = timed(lambda: flashinfer_ops.run_sink_prefill_ragged(wrapper, q, k, v, sinks, SCALE, out))
        tflops = prefill_flops(n, None) / (us * 1e-6) / 1e12
        results["prefill"].append({"backend": name, "tokens": n, "window": None, "us": us, "tflops": tflops, "err": err})
        print(f"prefill {name} N={n} window=None: {us:.0f}us {tflops:.1f} TFLOP/s err {err:.1e}", flush=True)


def run_dense(n, q, keys, values, sinks, results):
    """The full causal layer of a whole prompt through torch's fused SDPA kernels + the sink rescale
    (kernels/attention/dense_prefill.py), K/V contiguous rows as the rotary kernel leaves them (v a strided
    view of the QKV rows). Times the whole path, the SDPA call alone and the rescale alone."""
    qkv = torch.empty(n, (HQ + 2 * HKV) * D, dtype=q.dtype, device=DEV)
    qkv[:, (HQ + HKV) * D:] = values.reshape(n, HKV * D)
    v = qkv[:, (HQ + HKV) * D:].view(n, HKV, D)
    k = keys.contiguous()
    tail = 256
    ref = sink_attention(q[-tail:], keys, values, sinks, SCALE, None)
    for backend in ("cudnn", "flash"):
        name = f"torch-{backend}+rescale"
        try:
            out = dense_sink_prefill(q, k, v, sinks, SCALE, backend)
        except Exception as exc:  # an op this torch build lacks for these shapes: report, go on
            print(f"prefill {name} N={n}: unavailable ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
            results["prefill"].append({"backend": name, "tokens": n, "window": None, "error": str(exc)[:500]})
            continue
        err = rel_err(out[-tail:], ref)
        dest = torch.empty_like(q)
        us = timed(lambda: dense_sink_prefill(q, k, v, sinks, SCALE, backend, dest))
        sdpa_us = timed(lambda: causal_attention_lse(q, k, v, SCALE, backend))
        got, lse = causal_attention_lse(q, k, v, SCALE, backend)
        rescale_us = timed(lambda: sink_rescale(got, lse, sinks, dest))
        tflops = prefill_flops(n, None) / (us * 1e-6) / 1e12
        results["prefill"].append({"backend": name, "tokens": n, "window": None, "us": us, "tflops": tflops,
                                   "err": err, "sdpa_us": sdpa_us, "rescale_us": rescale_us})
        print(f"prefill {name} N={n}: {us:.0f}us {tflops:.1f} TFLOP/s (sdpa {sdpa_us:.0f} us, rescale "
              f"{rescale_us:.1f} us) err {err:.1e}", flush=True)


def print_table(results):
    print(f"\n{results['device']}  copy ceiling {results['copy_gbps']:.0f} GB/s  ({results['date']})")
    print("decode us (GB/s); triton_graph = CUDA-graph replay; swa = 128-key sliding layer")
    cols = ("triton", "triton_graph", "fi_sink", "fi_decode", "fi_decode_tc")
    print(f"{'B':>4} {'ctx':>6} {'spl':>3} | " + " | ".join(f"{c:>18}" for c in cols) + f" | {'swa graph':>9} {'swa fi':>7} | max err")
    for r in results["decode"]:
        err = max(r[k] for k in r if k.endswith("_err"))
        cells = " | ".join(f"{r[c + '_us']:>9.1f} ({r[c + '_gbps']:>5.0f})" for c in cols)
        print(f"{r['batch']:>4} {r['ctx']:>6} {r['splits']:>3} | {cells} | {r['triton_graph_swa_us']:>9.1f} "
              f"{r['fi_sink_swa_us']:>7.1f} | {err:.1e}")
    for r in results["prefill"]:
        if "us" not in r:
            continue
        print(f"prefill {r['backend']} N={r['tokens']:>6} window={str(r['window']):>4}: {r['us']:>9.0f} us "
              f"{r['tflops']:>6.1f} TFLOP/s  err {r['err']:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description="sink attention benchmark (decode + prefill)")
    parser.add_argument("--out", default="bench/results/attention_h200.json")
    parser.add_argument("--sweep", action="store_true", help="also sweep the decode kernel's launch shapes")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--prefill-only", action="store_true", help="skip decode")
    parser.add_argument("--prefill-backends", default=None, help="comma list (default: the device's default)")
    parser.add_argument("--prefill-lens", default=None, help="comma list of prompt lengths (default by --quick)")
    parser.add_argument("--full-triton", action="store_true",
                        help="also the full causal layers through the Triton paged kernel (a probe against fa3)")
    parser.add_argument("--ragged", action="store_true",
                        help="also the full layers through FlashInfer's ragged wrapper (contiguous K/V, no pages)")
    parser.add_argument("--dense", action="store_true",
                        help="also the full causal layers through torch's cuDNN / flash SDPA + the sink rescale")
    parser.add_argument("--sweep-only", default=None,
                        help="BxCTX list (e.g. 1x8192,4x8192): only the decode sweep at these points, wider split counts")
    args = parser.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    workspace = flashinfer_ops.new_workspace(DEV)
    fi_backend = flashinfer_ops.default_prefill_backend(DEV)
    results = {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(DEV),
        "torch": torch.__version__, "triton": triton.__version__, "flashinfer": flashinfer_ops.FLASHINFER_VERSION,
        "decode_config": {"full": default_decode_config(2, None).__dict__,
                          "sliding": default_decode_config(1, WINDOW).__dict__},
        "copy_gbps": copy_gbps(), "decode": [], "prefill": [], "sweep": [],
    }
    if args.sweep_only:
        run_sweep(gen, results, [tuple(int(v) for v in p.split("x")) for p in args.sweep_only.split(",")])
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
        for r in results["sweep"]:
            print(f"B={r['batch']} ctx={r['ctx']} block_n={r['block_n']} stages={r['num_stages']} splits={r['splits']:>2}"
                  f"{' (policy)' if r['policy'] else ''}: {r['graph_us']:.1f} us {r['gbps']:.0f} GB/s")
        return
    if args.sweep:
        run_sweep(gen, results)
    if not args.prefill_only:
        run_decode(args, gen, workspace, fi_backend, results)
    backends = args.prefill_backends.split(",") if args.prefill_backends else [fi_backend]
    run_prefill(args, gen, workspace, backends, results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print_table(results)


if __name__ == "__main__":
    main()
