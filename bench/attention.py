"""Sink attention on the GPU: decode (our Triton split-KV kernel beside FlashInfer) and prefill.

    python -m bench.attention [--sweep] [--quick] [--out bench/results/attention_h200.json]

Decode, batch 1/8/64/256 x context 1k/8k/32k, GQA 64/8, head_dim 64, bf16 pages of 16 tokens in
shuffled order, one new token per sequence: microseconds (median of triton.testing.do_bench, which
flushes L2 before every call) and achieved KV bandwidth, for
  triton      our kernel at the split count the backend picks (gpu_plan.decode_num_splits)
  fi_sink     FlashInfer's BatchAttentionWithAttentionSinkWrapper used for decode (fa3 on sm90)
  fi_decode   FlashInfer's BatchDecodeWithPagedKVCacheWrapper, no sinks (the bandwidth yardstick)
plus the sliding-window layer (128 keys) for triton and fi_sink. Prefill: one sequence of 1k/8k/32k
tokens through the sink wrapper, full causal and sliding, in TFLOP/s. Every implementation's output
is checked against kernels/attention/reference.py (fp32) before it is timed. `--sweep` times the
decode kernel's launch shapes and split counts on three shapes (how DecodeConfig was chosen).

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
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from kernels.attention import flashinfer_ops
from kernels.attention.decode_triton import DecodeConfig, sink_decode, split_scratch
from kernels.attention.gpu_plan import decode_num_splits, flashinfer_page_lists
from kernels.attention.reference import gather_pages, sink_attention

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


def bench_triton(shape: DecodeShape, window, splits: int, config: DecodeConfig):
    out = torch.empty_like(shape.q)
    part_o, part_lse = split_scratch(shape.batch, HQ, splits, D, DEV)

    def run():
        sink_decode(shape.q, shape.k, shape.v, shape.tables, shape.kv_lens, shape.sinks, SCALE, window, splits,
                    out, part_o, part_lse, config)

    run()
    err = shape.check(out, window, shape.sinks)
    return timed(run), err


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


def bench_fi_decode(shape: DecodeShape, workspace):
    wrapper = flashinfer_ops.decode_wrapper(workspace)
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
                ("triton", lambda: bench_triton(shape, None, splits, DecodeConfig())),
                ("fi_sink", lambda: bench_fi_sink(shape, None, workspace, fi_backend)),
                ("fi_decode", lambda: bench_fi_decode(shape, workspace)),
                ("triton_swa", lambda: bench_triton(shape, WINDOW, 1, DecodeConfig())),
                ("fi_sink_swa", lambda: bench_fi_sink(shape, WINDOW, workspace, fi_backend)),
            ):
                us, err = fn()
                row[f"{name}_us"], row[f"{name}_err"] = us, err
                if not name.endswith("swa"):
                    row[f"{name}_gbps"] = shape.kv_bytes / (us * 1e-6) / 1e9
            results["decode"].append(row)
            print(f"decode B={batch:<3} ctx={ctx:<6} " + " ".join(
                f"{n}={row[n + '_us']:.1f}us" for n in ("triton", "fi_sink", "fi_decode", "triton_swa")), flush=True)
        del pool_k, pool_v
        torch.cuda.empty_cache()


def run_sweep(gen, results):
    configs = [DecodeConfig(bn, w, s) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
    for batch, ctx in ((64, 8192), (8, 32768)):
        blocks = batch * ctx // PAGE + 64
        pool_k = torch.randn(blocks, PAGE, HKV, D, generator=gen, device=DEV).bfloat16()
        pool_v = torch.randn(blocks, PAGE, HKV, D, generator=gen, device=DEV).bfloat16()
        shape = DecodeShape(pool_k, pool_v, batch, ctx, gen)
        policy = decode_num_splits(batch, ctx, HKV, torch.cuda.get_device_properties(DEV).multi_processor_count)
        trials = [(c, policy) for c in configs] + [(DecodeConfig(), s) for s in (1, 2, 4, 8, 16) if s != policy]
        for config, splits in trials:
            try:
                us, err = bench_triton(shape, None, splits, config)
            except OutOfResources as exc:  # too much shared memory for this shape
                print(f"sweep skip {config}: {exc}")
                continue
            gbps = shape.kv_bytes / (us * 1e-6) / 1e9
            results["sweep"].append({"batch": batch, "ctx": ctx, "block_n": config.block_n, "num_warps": config.num_warps,
                                     "num_stages": config.num_stages, "splits": splits, "us": us, "gbps": gbps, "err": err})
        best = max((r for r in results["sweep"] if r["batch"] == batch and r["ctx"] == ctx), key=lambda r: r["gbps"])
        print(f"sweep B={batch} ctx={ctx}: best {best}", flush=True)
        del pool_k, pool_v
        torch.cuda.empty_cache()


def prefill_flops(n: int, window: int | None) -> float:
    pairs = sum(min(i + 1, window) for i in range(n)) if window else n * (n + 1) / 2
    return 4 * HQ * D * pairs


def run_prefill(args, gen, workspace, backends, results):
    for n in [1024, 8192] if args.quick else [1024, 8192, 32768]:
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


def print_table(results):
    print(f"\n{results['device']}  copy ceiling {results['copy_gbps']:.0f} GB/s  ({results['date']})")
    print(f"{'B':>4} {'ctx':>6} {'split':>5} | {'triton us':>9} {'GB/s':>6} | {'fi_sink us':>10} {'GB/s':>6} | "
          f"{'fi_decode us':>12} {'GB/s':>6} | {'swa triton':>10} {'swa fi_sink':>11} | max err")
    for r in results["decode"]:
        err = max(r[k] for k in r if k.endswith("_err"))
        print(f"{r['batch']:>4} {r['ctx']:>6} {r['splits']:>5} | {r['triton_us']:>9.1f} {r['triton_gbps']:>6.0f} | "
              f"{r['fi_sink_us']:>10.1f} {r['fi_sink_gbps']:>6.0f} | {r['fi_decode_us']:>12.1f} {r['fi_decode_gbps']:>6.0f} | "
              f"{r['triton_swa_us']:>10.1f} {r['fi_sink_swa_us']:>11.1f} | {err:.1e}")
    for r in results["prefill"]:
        print(f"prefill {r['backend']} N={r['tokens']:>6} window={str(r['window']):>4}: {r['us']:>9.0f} us "
              f"{r['tflops']:>6.1f} TFLOP/s  err {r['err']:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description="sink attention benchmark (decode + prefill)")
    parser.add_argument("--out", default="bench/results/attention_h200.json")
    parser.add_argument("--sweep", action="store_true", help="also sweep the decode kernel's launch shapes")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--prefill-backends", default=None, help="comma list (default: the device's default)")
    args = parser.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    workspace = flashinfer_ops.new_workspace(DEV)
    fi_backend = flashinfer_ops.default_prefill_backend(DEV)
    results = {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(DEV),
        "torch": torch.__version__, "triton": triton.__version__, "flashinfer": flashinfer_ops.FLASHINFER_VERSION,
        "decode_config": DecodeConfig().__dict__, "copy_gbps": copy_gbps(), "decode": [], "prefill": [], "sweep": [],
    }
    if args.sweep:
        run_sweep(gen, results)
    run_decode(args, gen, workspace, fi_backend, results)
    backends = args.prefill_backends.split(",") if args.prefill_backends else [fi_backend]
    run_prefill(args, gen, workspace, backends, results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print_table(results)


if __name__ == "__main__":
    main()
