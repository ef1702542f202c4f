"""Decode-step fusions A/B in one process: the same model, graphs re-captured per variant.

    python -m bench.decode_ab --out bench/results/decode_ab_h200.json          (on the GPU)

Variants (each a switch on the built model, so both sides share weights, KV pool and inputs):
- "unfused": router GEMM + topk + memset + plan + dispatch_quant, rotary then a separate KV write,
  cuBLAS for O, plain launches;
- "fused": Fp8Experts.fused_front (decode_front_triton: one launch for router..quantization), the
  rotary kernel writing k/v into the paged cache (backend.fuse_kv_write), O as a split-K GEMV
  (kernels/layers/gemv_triton.py);
- "fused+pdl": also programmatic dependent launch for our Triton kernels (kernels/pdl.py).
(Earlier runs of this bench, bench/results/decode_ab_*: front alone, front + KV write, and QKV on the
GEMV too, which was slower than cuBLAS.)

Per variant and batch: decode step time at a synthetic 8k context (bench/e2e.Harness: graph replay
+ argmax, median of 3 timed loops), then every kernel of one eager batch-1 step (torch.profiler):
name, launches, total us. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from bench.e2e import Harness
from engine.cuda_graphs import DecodeGraphs, default_buckets
from kernels import pdl
from model.config import GptOssConfig

VARIANTS = {"unfused": (False, False, False, False), "fused": (True, True, True, False),
            "fused+pdl": (True, True, True, True)}


def set_variant(h: Harness, front: bool, kv: bool, gemv: bool, use_pdl: bool) -> None:
    for layer in h.model.model.layers:
        layer.mlp.experts.fused_front = front
        layer.self_attn.decode_gemv = gemv
    h.model.backend.fuse_kv_write = kv
    pdl.ENABLED = use_pdl


def all_kernels(fn) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    return [{"name": e.key[:100], "calls": e.count, "us": round(e.device_time_total, 1)} for e in events]


def run(name: str, args) -> dict:
    config = GptOssConfig.preset(name)
    device = torch.device("cuda")
    h = Harness(name, config, device, args.max_batch, args.ctx + 64, args.headroom_gb)
    out = {"variants": {}}
    for variant, flags in VARIANTS.items():
        set_variant(h, *flags)
        h.graphs = None
        gc.collect()
        torch.cuda.empty_cache()
        h.graphs = DecodeGraphs(h.model, default_buckets(args.max_batch))
        t0 = time.perf_counter()
        h.graphs.capture()
        rec = {"capture_s": time.perf_counter() - t0, "decode": []}
        for b in args.batches:
            p = h.decode(b, args.ctx, args.steps, profile=False)
            rec["decode"].append({"batch": b, "step_ms": p["step_ms"], "tok_s_user": p["tok_s_user"],
                                  "tok_s_gpu": p["tok_s_gpu"]})
            print(f"[{name} {variant}] b={b}: {p['step_ms']:.3f} ms/step {p['tok_s_user']:.1f} tok/s/user", flush=True)
        attn = h.decode_batch(1, args.ctx)
        ids = torch.zeros(1, dtype=torch.long, device=device)
        pos = torch.full((1,), args.ctx, dtype=torch.long, device=device)
        h.graphs.run_eager(ids, pos, attn)
        kernels = all_kernels(lambda: h.graphs.run_eager(ids, pos, attn))
        rec["eager_b1_kernels"] = kernels
        rec["eager_b1_launches"] = sum(k["calls"] for k in kernels)
        rec["eager_b1_kernel_us"] = round(sum(k["us"] for k in kernels), 1)
        out["variants"][variant] = rec
    h = None  # frees the model before the next one
    gc.collect()
    torch.cuda.empty_cache()
    return out


def print_table(results: dict) -> None:
    for name, r in results["models"].items():
        base = r["variants"]["unfused"]
        print(f"\n{name}: decode step (ms) at ctx {results['args']['ctx']}, same process; ratio = unfused / variant")
        print(f"{'variant':10s} {'launches/step':>13s} {'kernel us':>10s} " +
              " ".join(f"{'b=' + str(d['batch']):>14s}" for d in base["decode"]))
        for variant, rec in r["variants"].items():
            cells = [f"{d['step_ms']:7.3f} x{b['step_ms'] / d['step_ms']:4.2f}" for d, b in zip(rec["decode"], base["decode"])]
            print(f"{variant:10s} {rec['eager_b1_launches']:13d} {rec['eager_b1_kernel_us']:10.1f} " + " ".join(f"{c:>14s}" for c in cells))
        best = list(r["variants"].values())[-1]
        print(f"kernels of one eager b=1 step ({list(r['variants'])[-1]}):")
        for k in best["eager_b1_kernels"][:24]:
            print(f"  {k['us']:9.1f} us {k['calls']:4d}x  {k['name']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="gpt-oss-20b,gpt-oss-120b")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--headroom-gb", type=float, default=10.0)
    p.add_argument("--out", default="bench/results/decode_ab.json")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    results = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "args": vars(args), "models": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        results["models"][name] = run(name, args)
        out.write_text(json.dumps(results, indent=1))
    print_table(results)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
