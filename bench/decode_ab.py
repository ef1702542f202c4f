"""Decode-step fusions A/B in one process: the same model, graphs re-captured per variant.

    python -m bench.decode_ab --out bench/results/decode_ab_h200.json          (on the GPU)

Variants (each a switch on the built model, so both sides share weights, KV pool and inputs):
- "unfused": router GEMM + topk + memset + plan + dispatch_quant, rotary then a separate KV write,
  cuBLAS for O, plain launches;
- "fused": Fp8Experts.fused_front (decode_front_triton: one launch for router..quantization), the
  rotary kernel writing k/v into the paged cache (backend.fuse_kv_write), O as a split-K GEMV
  (kernels/layers/gemv_triton.py);
- "fused+pdl": also programmatic dependent launch for our Triton kernels (kernels/pdl.py);
- "fp8-lm-head": fused+pdl with the unembedding as FP8 128x128-block weights (lm_head_dtype="fp8_e4m3",
  kernels/layers/fp8_linear.py, weight-only);
- "fp8-dense": the same for QKV and O too, which run on the slab GEMV at 1-2 tokens (kernels/layers/slab_gemv_triton.py)
  and, as the engine's dense_dtype="fp8_e4m3" builds them, on FP8 activations above 64 tokens (before 2026-12-06 this
  bench built them weight-only: steps above 64 sequences dequantized the weights per call);
  "fp8-dense-tc": without the slab GEMV (the tensor-core FP8 GEMV at every decode size: before 2026-12-02, measured
  slower than fp8-lm-head, kernels/layers/NOTES.md); "fp8-dense+mxfp4-8", "fp8-dense-tc+mxfp4-8": with the MXFP4
  decode experts of steps of <= 8 tokens too;
- "...-lm-head-64": the FP8 unembedding GEMV on the 64-row default config of QKV / O (what ran before
  2026-12-03) instead of fp8_gemv_triton.LARGE_N_CONFIG;
- "fp8-dense-read-k-padding": fp8-dense with the FP8 weights' zero K padding read by the decode kernels (before
  2026-12-03; kernels.moe.fp8_quant.READ_K_PADDING); "fp8-dense-splits-4" / "-3": the MoE decode GEMM's K split in
  4 (before 2026-12-03) / 3 at 2-4 tokens (default 2); "fp8-dense-t1-splits-2" / "-3": 2 / 3 at 1 token (default 4);
  "...-cuda-front": single-token steps' MoE front as one CUDA cluster (kernels/moe/decode_front_cuda.py);
  "fp8-dense-cuda-front-segments", "fp8-dense-segments", "fused+pdl-cuda-front-segments" (bf16 dense layers, the
  engine's defaults): with the MoE's contiguous GEMMs (steps above 64 tokens) on the segments GEMM up to 16 rows
  per expert (Fp8Experts.segments_max_rows).
  (The MoE decode GEMM on 32-row weight tiles, down only or both
  projections, was a variant of 2026-12-03 too: 3-7% slower, bench/results/decode_ab_k_padding_h200.)
- "mxfp4-decode": fused+pdl with the experts of steps of <= 16 tokens on the CUDA MXFP4 GEMM
  (kernels/moe/mxfp4_decode_layer.py); with it in the list the random experts are drawn as MXFP4 for every variant
  ("mxfp4-decode-8": steps of <= 8 tokens).
  The bf16 modules are kept and swapped back, so every variant runs the same weights (up to FP8 rounding).
(Earlier runs of this bench, bench/results/decode_ab_*: front alone, front + KV write, QKV on the
GEMV too, which was slower than cuBLAS, SwiGLU inside the down GEMM, 2.0x slower and removed:
kernels/moe/NOTES.md; the rotary embedding inside the split decode kernel, no gain and removed:
kernels/attention/NOTES.md.)

Per variant and batch: decode step time at a synthetic 8k context (bench/e2e.Harness: graph replay
+ argmax, median of 3 timed loops; with --rounds N the variant list runs N times in turn and each step time is
the median over the rounds), then every kernel of one eager step (torch.profiler): name, launches, total us
(batch --profile-batch); with --prefill-lens also each variant's prefill time (eager, Harness.prefill).
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.e2e import Harness
from engine.cuda_graphs import DecodeGraphs, default_buckets
from kernels import pdl
from kernels.layers import fp8_gemv_triton, fp8_linear
from kernels.moe import fp8_quant, triton_grouped_gemm
from model.config import GptOssConfig

SLAB_MAX_TOKENS = fp8_linear.SLAB_MAX_TOKENS  # restored after an fp8-dense-tc variant
LARGE_N = fp8_gemv_triton.LARGE_N  # restored after a -lm-head-64 variant

# (fused front, KV write in the rotary kernel, O GEMV, PDL, FP8 dense weights, MXFP4 decode tokens[, the FP8
# unembedding GEMV's large-N config: default True, fp8_gemv_triton.LARGE_N_CONFIG])
VARIANTS = {"unfused": (False, False, False, False, "", 0), "fused": (True, True, True, False, "", 0),
            "fused+pdl": (True, True, True, True, "", 0), "fp8-lm-head": (True, True, True, True, "lm_head", 0),
            "fp8-dense": (True, True, True, True, "all", 0), "fp8-dense-tc": (True, True, True, True, "all-tc", 0),
            "fp8-dense+mxfp4-8": (True, True, True, True, "all", 8),
            "fp8-dense-tc+mxfp4-8": (True, True, True, True, "all-tc", 8), "mxfp4-decode": (True, True, True, True, "", 16),
            "mxfp4-decode-8": (True, True, True, True, "", 8),
            "fp8-dense+mxfp4-8-lm-head-64": (True, True, True, True, "all", 8, False),
            "fp8-dense-lm-head-64": (True, True, True, True, "all", 0, False),
            "fp8-dense-read-k-padding": (True, True, True, True, "all", 0),
            "fp8-dense-splits-4": (True, True, True, True, "all", 0),
            "fp8-dense-splits-3": (True, True, True, True, "all", 0),
            "fp8-dense-t1-splits-2": (True, True, True, True, "all", 0),
            "fp8-dense-t1-splits-3": (True, True, True, True, "all", 0),
            "fp8-dense-cuda-front": (True, True, True, True, "all", 0),
            "fp8-dense+mxfp4-8-cuda-front": (True, True, True, True, "all", 8),
            "fused+pdl-cuda-front": (True, True, True, True, "", 0),
            "fp8-dense-cuda-front-segments": (True, True, True, True, "all", 0),
            "fp8-dense-segments": (True, True, True, True, "all", 0),
            "fused+pdl-cuda-front-segments": (True, True, True, True, "", 0)}
# Variants that also set (defaults otherwise): kernels.moe.fp8_quant.READ_K_PADDING, the MoE decode GEMM's K splits
# by step size (triton_grouped_gemm.SPLITS_BY_TOKENS), each MoE layer's cuda_front (the model's decode_front otherwise: off)
# and segments_max_rows (otherwise 0, DeepGEMM above 64 tokens, although Fp8Experts' default is 16 since 2026-12-06)
TWEAKS = {"fp8-dense-read-k-padding": dict(read_k_padding=True),
          "fp8-dense-splits-4": dict(splits={2: 4, 3: 4, 4: 4}),
          "fp8-dense-splits-3": dict(splits={2: 3, 3: 3, 4: 3}),
          "fp8-dense-t1-splits-2": dict(splits={1: 2}), "fp8-dense-t1-splits-3": dict(splits={1: 3}),
          "fp8-dense-cuda-front": dict(cuda_front=True), "fp8-dense+mxfp4-8-cuda-front": dict(cuda_front=True),
          "fused+pdl-cuda-front": dict(cuda_front=True),
          "fp8-dense-cuda-front-segments": dict(cuda_front=True, segments_max_rows=16),
          "fp8-dense-segments": dict(segments_max_rows=16),
          "fused+pdl-cuda-front-segments": dict(cuda_front=True, segments_max_rows=16)}


class DenseWeights:
    """The model's bf16 QKV / O / unembedding modules and (made on first use) their FP8 copies."""

    def __init__(self, model):
        self.model = model
        attn = [layer.self_attn for layer in model.model.layers]
        self.bf16 = {"qkv": [a.qkv_proj for a in attn], "o": [a.o_proj for a in attn], "lm_head": [model.lm_head]}
        self.fp8: dict = {}

    def use(self, which: str) -> None:
        """which: "" (all bf16), "lm_head" (FP8 unembedding), "all" (FP8 QKV, O and unembedding), "all-tc" (the same
        without the slab GEMV)."""
        fp8_linear.SLAB_MAX_TOKENS = 0 if which == "all-tc" else SLAB_MAX_TOKENS
        for kind, mods in self.bf16.items():
            fp8 = which in ("all", "all-tc") or which == kind
            if fp8 and kind not in self.fp8:
                # as the engine builds them: QKV / O with FP8 activations above 64 tokens (quantize_dense_fp8),
                # the unembedding weight-only (quantize_lm_head_fp8)
                self.fp8[kind] = [fp8_linear.Fp8Linear.from_linear(m, fp8_activations=kind != "lm_head") for m in mods]
            chosen = self.fp8[kind] if fp8 else mods
            if kind == "lm_head":
                self.model.lm_head = chosen[0]
            for layer, m in zip(self.model.model.layers, chosen if kind != "lm_head" else []):
                setattr(layer.self_attn, f"{kind}_proj", m)


def set_variant(h: Harness, front: bool, kv: bool, gemv: bool, use_pdl: bool, fp8: str, mxfp4: int,
                lm_head_large_config: bool = True, read_k_padding: bool = False, splits: dict | None = None,
                cuda_front: bool = False, segments_max_rows: int = 0) -> None:
    fp8_gemv_triton.LARGE_N = LARGE_N if lm_head_large_config else 1 << 62
    fp8_quant.READ_K_PADDING = read_k_padding
    triton_grouped_gemm.SPLITS_BY_TOKENS = dict(splits or {})
    for layer in h.model.model.layers:
        layer.mlp.experts.fused_front = front
        layer.mlp.experts.cuda_front = cuda_front
        layer.mlp.experts.segments_max_rows = segments_max_rows
        layer.self_attn.decode_gemv = gemv
        if mxfp4 or getattr(layer.mlp.experts, "mxfp4_max_tokens", 0):
            layer.mlp.experts.mxfp4_max_tokens = mxfp4
    h.model.backend.fuse_kv_write = kv
    pdl.ENABLED = use_pdl
    if fp8 or hasattr(h, "dense_weights"):
        if not hasattr(h, "dense_weights"):
            h.dense_weights = DenseWeights(h.model)
        h.dense_weights.use(fp8)


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
    # any MXFP4 variant: random experts drawn as MXFP4 and converted to FP8, so every variant computes one model
    mxfp4 = max(VARIANTS[v][5] for v in args.variants)
    # the CUDA front built (while the weights are drawn) only when a variant runs it; each variant sets it per layer
    front = "cuda" if any(TWEAKS.get(v, {}).get("cuda_front") for v in args.variants) else "triton"
    h = Harness(name, config, device, args.max_batch, max([args.ctx + 64] + args.prefill_lens), args.headroom_gb,
                mxfp4_decode_max_tokens=mxfp4, decode_front=front)
    out = {"variants": {}}
    for variant in args.variants * args.rounds:
        flags = VARIANTS[variant]
        set_variant(h, *flags, **TWEAKS.get(variant, {}))
        h.graphs = None
        gc.collect()
        torch.cuda.empty_cache()
        h.graphs = DecodeGraphs(h.model, default_buckets(args.max_batch))
        t0 = time.perf_counter()
        h.graphs.capture()
        rec = {"capture_s": time.perf_counter() - t0, "decode": []}
        seen = out["variants"].get(variant)
        for b in args.batches:
            if b > h.max_batch_at(args.ctx):
                print(f"[{name} {variant}] b={b}: skipped, the KV pool holds {h.max_batch_at(args.ctx)} at ctx {args.ctx}")
                continue
            p = h.decode(b, args.ctx, args.steps, profile=False)
            rec["decode"].append({"batch": b, "step_ms": p["step_ms"], "tok_s_user": p["tok_s_user"],
                                  "tok_s_gpu": p["tok_s_gpu"]})
            print(f"[{name} {variant}] b={b}: {p['step_ms']:.3f} ms/step {p['tok_s_user']:.1f} tok/s/user", flush=True)
        if seen is not None:  # a later round: its step times join the first round's record
            seen["rounds"].append(rec["decode"])
            for d in seen["decode"]:
                d["step_ms"] = statistics.median(r["step_ms"] for rnd in seen["rounds"] for r in rnd
                                                 if r["batch"] == d["batch"])
                d["tok_s_user"] = 1000.0 / d["step_ms"]
                d["tok_s_gpu"] = d["tok_s_user"] * d["batch"]
            continue
        rec["rounds"] = [[dict(d) for d in rec["decode"]]]
        rec["prefill"] = [{"tokens": n, "ttft_ms": h.prefill(n, False, n)["ttft_ms"]} for n in args.prefill_lens]
        for pt in rec["prefill"]:
            print(f"[{name} {variant}] prefill {pt['tokens']}: {pt['ttft_ms']:.2f} ms", flush=True)
        pb = args.profile_batch
        attn = h.decode_batch(pb, args.ctx)
        ids = torch.zeros(pb, dtype=torch.long, device=device)
        pos = torch.full((pb,), args.ctx, dtype=torch.long, device=device)
        h.graphs.run_eager(ids, pos, attn)
        kernels = all_kernels(lambda: h.graphs.run_eager(ids, pos, attn))
        rec.update(eager_batch=pb, eager_kernels=kernels, eager_launches=sum(k["calls"] for k in kernels),
                   eager_kernel_us=round(sum(k["us"] for k in kernels), 1))
        out["variants"][variant] = rec
    h = None  # frees the model before the next one
    gc.collect()
    torch.cuda.empty_cache()
    return out


def print_table(results: dict) -> None:
    for name, r in results["models"].items():
        if not r.get("variants"):
            print(f"\n{name}: no results (exit {r.get('exit')})")
            continue
        first = next(iter(r["variants"]))
        base = r["variants"][first]
        print(f"\n{name}: decode step (ms) at ctx {results['args']['ctx']}, same process; ratio = {first} / variant")
        print(f"{'variant':10s} {'launches/step':>13s} {'kernel us':>10s} " +
              " ".join(f"{'b=' + str(d['batch']):>14s}" for d in base["decode"]) +
              "".join(f" {'prefill ' + str(d['tokens']):>14s}" for d in base["prefill"]))
        for variant, rec in r["variants"].items():
            cells = [f"{d['step_ms']:7.3f} x{b['step_ms'] / d['step_ms']:4.2f}" for d, b in zip(rec["decode"], base["decode"])]
            cells += [""] * (len(base["decode"]) - len(rec["decode"]))
            cells += [f"{d['ttft_ms']:7.2f} x{b['ttft_ms'] / d['ttft_ms']:4.2f}" for d, b in zip(rec["prefill"], base["prefill"])]
            print(f"{variant:10s} {rec['eager_launches']:13d} {rec['eager_kernel_us']:10.1f} " + " ".join(f"{c:>14s}" for c in cells))
        for variant, rec in r["variants"].items():
            print(f"kernels of one eager b={rec['eager_batch']} step ({variant}):")
            for k in rec["eager_kernels"][:14]:
                print(f"  {k['us']:9.1f} us {k['calls']:4d}x  {k['name']}")


def child_argv(argv: list[str] | None, model: str, out: Path) -> list[str]:
    """This run's arguments for one model, its JSON written to `out`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--models", "--out"):
            skip = True
            continue
        if arg.startswith(("--models=", "--out=")):
            continue
        kept.append(arg)
    return [*kept, "--models", model, "--out", str(out)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="gpt-oss-20b,gpt-oss-120b")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"from {list(VARIANTS)}; the first is the baseline")
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--prefill-lens", default="", help="prompt lengths to time per variant too (one chunk each)")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the variant list this many times, interleaved; step times: the median over rounds")
    p.add_argument("--profile-batch", type=int, default=1, help="batch of the eager step whose kernels are listed")
    p.add_argument("--headroom-gb", type=float, default=10.0)
    p.add_argument("--out", default="bench/results/decode_ab.json")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.variants = args.variants.split(",")
    args.prefill_lens = [int(n) for n in args.prefill_lens.split(",") if n]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        p.error(f"--variants: names from {list(VARIANTS)}")
    results = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "args": vars(args), "models": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    names = args.models.split(",")
    for name in names:
        if len(names) == 1:
            results["models"][name] = run(name, args)
        else:  # each model in a fresh process: the first one's memory was not all returned to the second
            part = out.with_suffix(f".{name}.json")
            cmd = [sys.executable, "-m", "bench.decode_ab", *child_argv(argv, name, part)]
            rc = subprocess.run(cmd).returncode
            results["models"][name] = json.loads(part.read_text())["models"][name] if part.exists() else {"exit": rc}
            part.unlink(missing_ok=True)
        out.write_text(json.dumps(results, indent=1))
    print_table(results)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
