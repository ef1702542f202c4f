"""The MoE layer between decode and prefill sizes: DeepGEMM's contiguous grouped GEMMs (what runs above 64 tokens)
against the weight-streaming GEMM over contiguous segments (triton_grouped_gemm.grouped_gemm_segments), per launch
config, in one process.

    python -m bench.moe_segments [--tokens 96,128,256,512,1024,2048] [--models 20b,120b] [--out FILE]

Bytes first: below ~100 rows per expert the layer reads every active expert's 25.44 MB of FP8 weights once and does
49.8 MFLOP per token-expert pair, so 120b at 512 tokens (all 128 experts, 3.26 GB, 102 GFLOP) is bound by the bytes
(757 us at 4.3 TB/s; 80 us of FLOPs at 1.27 PFLOP/s), while DeepGEMM computes a whole 128-row tile per expert for
the ~16 rows each holds. 20b at 512 tokens (32 experts x ~64 rows: 814 MB, 102 GFLOP) sits near the crossover.
Each variant is checked against the bf16 reference (1 - 2<x,y>/(|x|^2+|y|^2)) before it is timed; times are CUDA
graphs (PDL on, as in the engine's decode graphs) over 4 routings (2 above 1k tokens).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from bench.moe import Layer, inputs, layer_row
from bench.moe_common import FP8_EXPERT_BYTES, MODELS, calc_diff, graph_time_us
from kernels.moe import deep_gemm_ops
from kernels.moe import triton_grouped_gemm as tgg

# (BLOCK_N, num_warps, num_stages) of the segments kernel; BLOCK_T from tgg.segments_block_t, and twice that
CONFIGS = [(64, 4, 3), (64, 4, 4), (128, 4, 3)]  # (128, 8, 3) and (32, 4, 4): slower everywhere on an H100


def run_case(layer: Layer, model: str, t: int) -> list[dict]:
    rows = []
    sets = inputs(t, layer.e, 4 if t <= 1024 else 2, seed=t)
    distinct = sum(int(torch.unique(s[1]).numel()) for s in sets) / len(sets)
    fp8 = layer.fp8
    fp8.masked_max_tokens, fp8.use_psum = 64, True
    fp8.backend = "deep_gemm" if deep_gemm_ops.available() else "triton"
    base_block_t = tgg.segments_block_t(t * 4 / layer.e)
    variants = [("deep_gemm" if fp8.backend == "deep_gemm" else "triton_general", None, None)]
    for cfg in CONFIGS:
        for block_t in sorted({base_block_t, min(128, 2 * base_block_t)}):
            variants.append((f"seg n{cfg[0]} w{cfg[1]} s{cfg[2]} t{block_t}", cfg, block_t))
    default_cfg, default_rule = dict(tgg.SEGMENTS_CONFIG), tgg.segments_block_t
    for name, cfg, block_t in variants:
        try:
            if cfg is None:
                fp8.segments_max_rows = 0
            else:
                fp8.segments_max_rows = 10 ** 6
                tgg.SEGMENTS_CONFIG = dict(BLOCK_N=cfg[0], num_warps=cfg[1], num_stages=cfg[2])
                tgg.segments_block_t = lambda rows, b=block_t: b
            diff = calc_diff(fp8(*sets[0]), layer.ref(*sets[0]))
            us, mode = graph_time_us(fp8, sets)
        except RuntimeError as exc:  # report and go on
            print(f"{model:>5} T={t:<6} {name:<28} FAILED {str(exc).splitlines()[0][:160]}", flush=True)
            rows.append(dict(model=model, tokens=t, variant=name, error=str(exc)[:300]))
            continue
        finally:
            tgg.SEGMENTS_CONFIG, tgg.segments_block_t = dict(default_cfg), default_rule
            fp8.segments_max_rows = 0
        rows.append(layer_row(model, layer.e, t, name, us, mode, diff, distinct, FP8_EXPERT_BYTES))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="96,128,256,512,1024")
    p.add_argument("--models", default="20b,120b")
    p.add_argument("--out", default="bench/results/moe_segments.json")
    args = p.parse_args(argv)
    tokens = [int(x) for x in args.tokens.split(",")]
    rows = []
    for model in args.models.split(","):
        layer = Layer(MODELS[model])
        for t in tokens:
            rows += run_case(layer, model, t)
        del layer
        torch.cuda.empty_cache()
    print("\nmodel   T      baseline us   best segments us (config)            ratio")
    for model in args.models.split(","):
        for t in tokens:
            case = [r for r in rows if r["model"] == model and r["tokens"] == t and "us" in r]
            base = [r for r in case if not r["variant"].startswith("seg")]
            segs = [r for r in case if r["variant"].startswith("seg") and r["diff_vs_bf16_ref"] <= 1e-3]
            if base and segs:
                best = min(segs, key=lambda r: r["us"])
                print(f"{model:>5} {t:>6} {base[0]['us']:12.1f}   {best['us']:10.1f} ({best['variant']:<26})"
                      f" {base[0]['us'] / best['us']:6.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                                          "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "deep_gemm": deep_gemm_ops.available(), "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
