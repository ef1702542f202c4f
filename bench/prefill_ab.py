"""Eager prefill TTFT of prefill variants in one process (random weights of the real shapes). Per length,
`--rounds` rounds each time every variant once (median of 3 forwards back to back, then of 3 after 0.3 s of
rest: Harness.prefill) in turn, so drift hits them alike; reported: the median and the minimum over rounds,
the median after a rest, and the summed GPU kernel time of one forward per variant (torch.profiler, 4
forwards), which host noise does not reach.

    python -m bench.prefill_ab --model gpt-oss-20b --lens 1024,4096 --variants sliding \\
        --out bench/results/prefill_ab_sliding_h200.json

Variant sets:
- `pdl`: programmatic dependent launch off / on for every launch / on only under CUDA-graph capture
  (kernels/pdl.py's default); `bench/results/pdl_prefill_ab_h200.json` (2026-11-30) came from it.
- `sliding`: the sliding-window layers through FlashInfer's windowed sink prefill / our Triton kernel
  (kernels/attention/sliding_prefill_triton.py) / the Triton kernel plus the approximate-division
  SwiGLU epilogue (Fp8Experts.swiglu_fast_div).
- `graphs`: eager forwards against the piecewise prefill CUDA graphs (engine/prefill_graphs.py), one
  bucket captured per chunk length, with and without programmatic dependent launch in the graphs.
- `ragged`: the full layers of whole prompts over pages or over the step's k / v rows, eager and with graphs.
- `fp8-dense`: QKV / O in bf16 (cuBLAS, the default) against FP8 weights with FP8 activations above 64 tokens
  (EngineConfig.dense_dtype="fp8_e4m3", DeepGEMM's FP8 GEMM), both under prefill graphs captured per variant.
- `defer-plan`: the full layers' ragged plan up front in plan() or at the step's first full layer
  (FlashInferAttentionBackend.defer_ragged_plan), with bf16 and with FP8 QKV / O, under prefill graphs.
- `sliding-rows`: the sliding layers of whole prompts over the K/V pages or over the step's own k / v rows
  (FlashInferAttentionBackend.sliding_rows, the default), under prefill graphs captured for each (the rows
  setting keeps every layer's k / v rows in the graphs' buffers).
- `swiglu-mufu`: the prefill SwiGLU row tiles as shipped / reading (gate, up) pairs as int32 words / words and
  the SFU sigmoid / those and the dispatch quantization by a per-block reciprocal (Fp8Experts.swiglu_words,
  swiglu_mufu, dispatch_fast_div; eager forwards).
- `segments`: the MoE's contiguous GEMMs on DeepGEMM / on the weight-streaming segments GEMM up to 16 (the default) /
  64 rows per expert (Fp8Experts.segments_max_rows; eager forwards).
- `masked`: the prefill MoE in the contiguous layout above 64 tokens (the default) or the masked layout
  up to 1k tokens (eager forwards).
Without DG_USE=1 in scripts/device_env.sh the prefill GEMMs are the Triton grouped GEMM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.e2e import Harness
from kernels import pdl
from model.config import GptOssConfig


def pdl_variants():
    def mode(enabled: bool, capture_only: bool):
        def apply(h: Harness):
            pdl.ENABLED, pdl.CAPTURE_ONLY = enabled, capture_only
        return apply
    return {"off": mode(False, True), "all launches": mode(True, False), "capture only": mode(True, True)}


def set_on_experts(h: Harness, name: str, value) -> None:
    """Set attribute `name` on every layer's experts module that has it (Fp8Experts' switches)."""
    for layer in h.model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and hasattr(experts, name):
            setattr(experts, name, value)


def sliding_variants():
    def mode(sliding: str, fast_div: bool):
        def apply(h: Harness):
            h.model.backend.sliding_prefill = sliding
            set_on_experts(h, "swiglu_fast_div", fast_div)
        return apply
    return {"flashinfer sliding": mode("flashinfer", False), "triton sliding": mode("triton", False),
            "triton sliding + fast swiglu": mode("triton", None)}


def graphs_variants():
    """Eager forwards; piecewise graphs captured with PDL; the same graphs captured without it. The graph
    sets are captured by main() (capture_graphs) and switched in here."""
    def mode(key: str | None):
        def apply(h: Harness):
            h.prefill_graphs = None if key is None else h.graph_sets[key]
        return apply
    return {"eager": mode(None), "graphs": mode("pdl"), "graphs, no PDL": mode("no pdl")}


def capture_graphs(h: Harness, buckets: list[int]) -> dict:
    h.graph_sets, seconds = {}, {}
    for key, pdl_on in (("pdl", True), ("no pdl", False)):
        seconds[key] = h.capture_prefill_graphs(buckets, pdl=pdl_on)
        h.graph_sets[key] = h.prefill_graphs
    return seconds


def masked_variants():
    """The prefill MoE in DeepGEMM's contiguous layout (what runs above 64 tokens) against its masked layout
    up to 1,024 tokens (measured 3-6% faster on the layer at 512 tokens, kernels/moe/NOTES.md).
    Eager forwards: compare the kernel sums."""
    def mode(limit: int):
        def apply(h: Harness):
            h.prefill_graphs = None
            set_on_experts(h, "masked_max_tokens", limit)
        return apply
    # (the masked layout holds E x align(T) rows: 120b's gate_up output at 1k tokens is 1.5 GB, so no higher)
    return {"contiguous above 64": mode(64), "masked to 1024": mode(1024)}


def segments_variants():
    """The prefill MoE's contiguous GEMMs on DeepGEMM against the weight-streaming GEMM over segments
    (Fp8Experts.segments_max_rows: on while experts average at most that many rows). Eager forwards."""
    def mode(rows: int):
        def apply(h: Harness):
            h.prefill_graphs = None
            set_on_experts(h, "segments_max_rows", rows)
        return apply
    # 16: the default since 2026-12-06; the H100 run of that day (prefill_ab_segments_20b_h100) had 0 / 64 / 128
    return {"deep_gemm": mode(0), "segments to 16 rows": mode(16), "segments to 64 rows": mode(64)}


def swiglu_tiles_variants():
    """The prefill SwiGLU epilogue per pair against row tiles of the contiguous layout
    (Fp8Experts.swiglu_tiles, the default since 2026-11-30; bitwise the same output). Eager forwards."""
    def mode(tiles: bool):
        def apply(h: Harness):
            h.prefill_graphs = None
            set_on_experts(h, "swiglu_tiles", tiles)
        return apply
    return {"swiglu per pair": mode(False), "swiglu row tiles": mode(True)}


def swiglu_mufu_variants():
    """The prefill SwiGLU row tiles reading bf16 halves with the fast division's sigmoid (the default until
    2026-12-06), reading (gate, up) pairs as int32 words (Fp8Experts.swiglu_words, bitwise the same), words + the SFU
    sigmoid (swiglu_mufu; the default since), and those with the dispatch quantization's per-block reciprocal
    (dispatch_fast_div). Eager forwards: compare the kernel sums."""
    def mode(words: bool, mufu: bool, dispatch_fast_div: bool = False):
        def apply(h: Harness):
            h.prefill_graphs = None
            set_on_experts(h, "swiglu_words", words)
            set_on_experts(h, "swiglu_mufu", mufu)
            set_on_experts(h, "dispatch_fast_div", dispatch_fast_div)
        return apply
    return {"swiglu tiles": mode(False, False), "swiglu words": mode(True, False),
            "swiglu words + mufu": mode(True, True), "words + mufu + dispatch fast div": mode(True, True, True)}


def rotary_tiles_variants():
    """The prefill rotary (+ K/V write) kernel at one token per program against ROTARY_BLOCK_T tokens per program
    (kernels/layers/triton_ops.py; bitwise the same outputs). Eager forwards: compare the kernel sums."""
    from kernels.layers import triton_ops

    def mode(tiled_from: int):
        def apply(h: Harness):
            h.prefill_graphs = None
            triton_ops.ROTARY_TILED_FROM = tiled_from
        return apply
    return {"rotary token per program": mode(1 << 30), "rotary 4 tokens per program": mode(256)}


def ragged_variants():
    """The full layers of a whole prompt through FlashInfer's paged sink prefill or its ragged one over the step's
    own k / v rows (FlashInferAttentionBackend.ragged_full, the default), eagerly and under the piecewise prefill
    graphs (captured by main())."""
    def mode(ragged: bool, graphs: bool):
        def apply(h: Harness):
            h.model.backend.ragged_full = ragged
            h.prefill_graphs = h.graph_sets["pdl"] if graphs else None
        return apply
    return {"eager, paged": mode(False, False), "eager, ragged": mode(True, False),
            "graphs, paged": mode(False, True), "graphs, ragged": mode(True, True)}


class DenseSwap:
    """Every layer's QKV / O as the model's bf16 nn.Linear or as FP8 copies (Fp8Linear, FP8 activations above 64
    tokens): `use("bf16" | "fp8")` puts one set in place."""

    def __init__(self, h: Harness):
        from kernels.layers.fp8_linear import Fp8Linear

        attns = [layer.self_attn for layer in h.model.model.layers]
        self.sets = {"bf16": [(a.qkv_proj, a.o_proj) for a in attns]}
        self.sets["fp8"] = [tuple(Fp8Linear.from_linear(m, fp8_activations=True) for m in pair)
                            for pair in self.sets["bf16"]]
        self.attns = attns

    def use(self, key: str) -> None:
        for a, (q, o) in zip(self.attns, self.sets[key]):
            a.qkv_proj, a.o_proj = q, o


def dense_variants():
    """QKV / O in bf16 or FP8 (DenseSwap), each with the prefill graphs main() captured on its own modules."""
    def mode(key: str):
        def apply(h: Harness):
            h.dense_weights.use(key)
            h.prefill_graphs = h.graph_sets[key]
        return apply
    return {"bf16 dense": mode("bf16"), "fp8 dense": mode("fp8")}


def defer_plan_variants():
    """The ragged plan up front / deferred, each with bf16 and FP8 QKV / O (graphs captured by main())."""
    def mode(key: str, defer: bool):
        def apply(h: Harness):
            h.dense_weights.use(key)
            h.prefill_graphs = h.graph_sets[key]
            h.model.backend.defer_ragged_plan = defer
        return apply
    return {"bf16, plan up front": mode("bf16", False), "bf16, plan deferred": mode("bf16", True),
            "fp8 dense, plan up front": mode("fp8", False), "fp8 dense, plan deferred": mode("fp8", True)}


def sliding_rows_variants():
    """The sliding kernel over the pages / over the step's k / v rows, each under its own prefill graphs, with
    the keys past two whole 64-key steps in one 64-key step or in 16-key steps (SlidingPrefillConfig.tail_n)."""
    from kernels.attention.sliding_prefill_triton import SlidingPrefillConfig

    def mode(rows: bool, tail_n: int):
        def apply(h: Harness):
            h.model.backend.sliding_rows = rows
            h.model.backend.sliding_prefill_config = SlidingPrefillConfig(tail_n=tail_n)
            h.prefill_graphs = h.graph_sets[rows]
        return apply
    return {"pages": mode(False, 0), "pages, tail 16": mode(False, 16), "rows": mode(True, 0),
            "rows, tail 16": mode(True, 16)}


def capture_row_graphs(h: Harness, buckets: list[int]) -> dict:
    h.graph_sets, seconds = {}, {}
    for rows in (False, True):
        h.model.backend.sliding_rows = rows
        seconds["rows" if rows else "pages"] = h.capture_prefill_graphs(buckets, pdl=True)
        h.graph_sets[rows] = h.prefill_graphs
    return seconds


def capture_dense_graphs(h: Harness, buckets: list[int]) -> dict:
    h.dense_weights, h.graph_sets, seconds = DenseSwap(h), {}, {}
    for key in ("bf16", "fp8"):
        h.dense_weights.use(key)
        seconds[key] = h.capture_prefill_graphs(buckets, pdl=True)
        h.graph_sets[key] = h.prefill_graphs
    return seconds


VARIANTS = {"pdl": pdl_variants, "sliding": sliding_variants, "graphs": graphs_variants, "masked": masked_variants,
            "swiglu-tiles": swiglu_tiles_variants, "segments": segments_variants, "swiglu-mufu": swiglu_mufu_variants,
            "rotary-tiles": rotary_tiles_variants,
            "ragged": ragged_variants, "fp8-dense": dense_variants, "defer-plan": defer_plan_variants,
            "sliding-rows": sliding_rows_variants}


PROFILED_FORWARDS = 4


def kernel_profile(run) -> dict:
    """PROFILED_FORWARDS calls of `run` (one prefill forward, Harness.prefill_runner) under the profiler: summed
    GPU kernel time per forward, and the idle gaps between consecutive kernels per forward, by size (gaps of 1 ms
    and more are the host's syncs between the forwards and are left out)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_FORWARDS):
            run()
        torch.cuda.synchronize()
    # kernels and copies only (a CPU op also reports the device time of what it launched)
    total_us = sum(e.self_device_time_total for e in prof.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0)
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    bins = {"<5us": 0.0, "5-50us": 0.0, "50us-1ms": 0.0}
    largest = []
    end_so_far = spans[0][1] if spans else 0
    for (start, end, name), prev in zip(spans[1:], spans):
        gap = start - end_so_far
        end_so_far = max(end_so_far, end)
        if gap <= 0 or gap >= 1000:
            continue
        bins["<5us" if gap < 5 else "5-50us" if gap < 50 else "50us-1ms"] += gap
        largest.append((gap, prev[2][:40], name[:40]))
    largest.sort(reverse=True)
    f = PROFILED_FORWARDS
    by_name = sorted(((e.self_device_time_total / 1e3 / f, e.key[:60]) for e in prof.key_averages()
                      if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0),
                     reverse=True)
    return {"kernels_ms": total_us / 1e3 / f, "gaps_ms": {k: v / 1e3 / f for k, v in bins.items()},
            "largest_gaps_us": [[round(g, 1), a, b] for g, a, b in largest[:6]],
            "top_kernels_ms": [[round(ms, 3), name] for ms, name in by_name[:12]]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--lens", default="1024,2048,8192")
    p.add_argument("--variants", choices=sorted(VARIANTS), default="sliding")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk (max_num_batched_tokens)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="bench/results/prefill_ab.json")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8_e4m3")
    p.add_argument("--dense-dtype", default="auto", help="QKV / O weights: auto (bf16) or fp8_e4m3")
    args = p.parse_args(argv)
    lens = [int(x) for x in args.lens.split(",")]
    h = Harness(args.model, GptOssConfig.preset(args.model), torch.device("cuda"), 1, max(lens) + 64, 10.0,
                kv_cache_dtype=args.kv_cache_dtype, dense_dtype=args.dense_dtype)
    variants = VARIANTS[args.variants]()
    capture = {}
    buckets = sorted({min(args.chunk, n - s) for n in lens for s in range(0, n, args.chunk)})
    if args.variants in ("graphs", "ragged"):  # a bucket per chunk length the prompts are cut into
        capture = capture_graphs(h, buckets)
        print(f"prefill graphs captured (s per bucket): {capture}", flush=True)
    elif args.variants in ("fp8-dense", "defer-plan"):
        capture = capture_dense_graphs(h, buckets)
        print(f"prefill graphs captured per dense dtype (s): {capture}", flush=True)
    elif args.variants == "sliding-rows":
        capture = capture_row_graphs(h, buckets)
        print(f"prefill graphs captured per sliding K/V source (s): {capture}", flush=True)
    rows = []
    for n in lens:
        walls = {name: [] for name in variants}
        rested = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, apply in variants.items():
                apply(h)
                point = h.prefill(n, profile=False, chunk=args.chunk)
                walls[name].append(point["ttft_ms"])
                rested[name].append(point["ttft_after_rest_ms"])
        row = {"tokens": n}
        for name, apply in variants.items():
            apply(h)
            row[name] = statistics.median(walls[name])
            row[name + " min"] = min(walls[name])
            row[name + " after rest"] = statistics.median(rested[name])
            prof = kernel_profile(h.prefill_runner(n, args.chunk)[0])
            row[name + " kernels"] = prof["kernels_ms"]
            row[name + " gaps"] = prof
        rows.append(row)
        print(f"tokens={n}: " + "; ".join(f"{name} {row[name]:.2f} (min {row[name + ' min']:.2f}, after a rest "
                                           f"{row[name + ' after rest']:.2f}, kernels {row[name + ' kernels']:.2f}) ms"
                                           for name in variants), flush=True)
        for name in variants:
            g = row[name + " gaps"]
            print(f"  {name}: idle between kernels per forward (ms) "
                  + ", ".join(f"{k} {v:.2f}" for k, v in g["gaps_ms"].items())
                  + f"; largest (us): {g['largest_gaps_us'][:3]}", flush=True)
            print(f"  {name}: top kernels (ms per forward) "
                  + ", ".join(f"{n} {ms:.2f}" for ms, n in g["top_kernels_ms"]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "model": args.model, "variants": list(variants), "ttft_ms": rows,
                                          "capture_s": capture}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
