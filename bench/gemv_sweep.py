"""Decode GEMVs against cuBLAS (F.linear) on gpt-oss's QKV, O and unembedding shapes.

    python -m bench.gemv_sweep --out bench/results/gemv_h200.json

bf16 weights: our split-K GEMV (kernels/layers/gemv_triton.py) in several configs and cuBLAS. FP8
weights (lm_head_dtype="fp8_e4m3"): the weight-only FP8 GEMV (kernels/layers/fp8_gemv_triton.py)
in several configs. Each call captured 50 times in one CUDA graph, replay timed (launch gaps included,
as in the decode step); us per call and weight-stream TB/s (bytes of the weights as stored), T = 1, 4, 16.
Timing: bench/moe_common.graph_us (triton do_bench median over graph replays); the gemv_h200.json of
2026-11-30 (bf16 only) was timed with CUDA events, median of 5 replays, over the same graph.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.moe_common import graph_us
from kernels.layers import fp8_gemv_triton, gemv_triton
from kernels.layers.fp8_linear import quantize_weight

SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "unembed": (201088, 2880)}
CONFIGS = [dict(BLOCK_N=64, BLOCK_K=128, waves=2, num_stages=4), dict(BLOCK_N=64, BLOCK_K=256, waves=2, num_stages=3),
           dict(BLOCK_N=32, BLOCK_K=256, waves=2, num_stages=3), dict(BLOCK_N=64, BLOCK_K=128, waves=4, num_stages=4),
           dict(BLOCK_N=128, BLOCK_K=128, waves=2, num_stages=4), dict(BLOCK_N=64, BLOCK_K=256, waves=1, num_stages=4)]
# 2026-11-30 first sweep (T <= 16) also tried BLOCK_N=64 with 6 stages and BLOCK_N=128 with 8 warps: slower everywhere
FP8_CONFIGS = [dict(BLOCK_N=64, waves=2, num_stages=4), dict(BLOCK_N=128, waves=2, num_stages=4),
               dict(BLOCK_N=64, waves=4, num_stages=4), dict(BLOCK_N=128, waves=4, num_stages=3)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/gemv.json")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default="1,4,16,32,64")
    p.add_argument("--bf16-configs", action="store_true", help="also sweep the bf16 GEMV's configs (else its default)")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    dev = torch.device("cuda")
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        b = torch.randn(n, device=dev, dtype=torch.bfloat16) if name != "unembed" else None
        wq, sw = quantize_weight(w)
        tickets = gemv_triton.new_tickets(n, dev)
        for t in args.tokens:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            row = {"shape": name, "n": n, "k": k, "tokens": t, "cublas_us": graph_us(lambda: F.linear(x, w, b))}
            if t <= gemv_triton.GEMV_MAX_TOKENS:
                for i, cfg in enumerate(CONFIGS if args.bf16_configs else CONFIGS[:1]):
                    row[f"cfg{i}_us"] = graph_us(lambda: gemv_triton.gemv(x, w, b, tickets, cfg))
            # the FP8 weights' other path: exact bf16 dequantization + cuBLAS
            row["fp8_dequant_cublas_us"] = graph_us(lambda: F.linear(x, fp8_gemv_triton.dequantize(wq, sw, k, x.dtype), b))
            for i, cfg in enumerate(FP8_CONFIGS):
                row[f"fp8cfg{i}_us"] = graph_us(lambda: fp8_gemv_triton.fp8_gemv(x, wq, sw, b, tickets, cfg))
            best = min([(v, key) for key, v in row.items() if key.startswith("cfg")] + [(row["cublas_us"], "cublas_us")])
            best8 = min((v, key) for key, v in row.items() if key.startswith("fp8cfg"))
            row.update(best=best[1], best_tb_s=n * k * 2 / (best[0] * 1e-6) / 1e12,
                       cublas_tb_s=n * k * 2 / (row["cublas_us"] * 1e-6) / 1e12,
                       fp8_best=best8[1], fp8_best_us=best8[0], fp8_tb_s=wq.numel() / (best8[0] * 1e-6) / 1e12,
                       fp8_speedup_vs_best_bf16=min(best[0], row["cublas_us"]) / best8[0])
            rows.append(row)
            print(" ".join(f"{key}={v:.2f}" if isinstance(v, float) else f"{key}={v}" for key, v in row.items()), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "device": torch.cuda.get_device_name(), "configs": CONFIGS,
                                          "fp8_configs": FP8_CONFIGS, "rows": rows}, indent=1))
    print(f"\n{'shape':8s} {'T':>3s} {'cuBLAS us':>9s} {'best bf16':>9s} {'FP8 GEMV':>9s} {'FP8 TB/s':>8s} {'speedup':>7s} "
          f"{'FP8 deq+cuBLAS':>14s}")
    for r in rows:
        print(f"{r['shape']:8s} {r['tokens']:3d} {r['cublas_us']:9.2f} {r[r['best']]:9.2f} {r['fp8_best_us']:9.2f} "
              f"{r['fp8_tb_s']:8.2f} {r['fp8_speedup_vs_best_bf16']:7.2f} {r['fp8_dequant_cublas_us']:14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
