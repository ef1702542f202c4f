"""The slab GEMV (kernels/layers/slab_gemv_triton.py) against the decode projections' kernels, weights from HBM.

    python -m bench.gemv_slab --out bench/results/gemv_slab_h200.json

For gpt-oss's QKV (5120 x 2880) and O (2880 x 4096) shapes (the same in 20b and 120b) and T = 1, 2, 4 tokens:
cuBLAS on bf16 weights (what QKV runs), the split-K bf16 GEMV (what O runs), the FP8 tensor-core GEMV
(`dense_dtype="fp8_e4m3"` at decode), and the slab GEMV on FP8 and bf16 weights in several configs. Each
variant is captured as 48 calls in one CUDA graph cycling through enough copies of the weights (>= 200 MB) that
every call reads its weights from HBM, as in a decode step where each layer has its own; us per call (median of
graph replays, launch gaps included) and the weights' TB/s as stored. Every slab result is first checked against
its twin (fp8_linear.reference / F.linear in fp32) on these inputs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.moe_common import graph_time_us
from kernels.layers import fp8_gemv_triton, gemv_triton, slab_gemv_triton
from kernels.layers.fp8_linear import quantize_weight, reference

SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "unembed": (201088, 2880)}
SLAB_CONFIGS = [dict(BLOCK_N=16, K_SPLIT=1024, num_warps=4), dict(BLOCK_N=16, K_SPLIT=512, num_warps=4),
                dict(BLOCK_N=32, K_SPLIT=512, num_warps=4), dict(BLOCK_N=16, K_SPLIT=256, num_warps=4),
                dict(BLOCK_N=32, K_SPLIT=256, num_warps=4), dict(BLOCK_N=32, K_SPLIT=1024, num_warps=8),
                dict(BLOCK_N=16, K_SPLIT=512, num_warps=2), dict(BLOCK_N=64, K_SPLIT=256, num_warps=4),
                # for the unembedding (2026-12-03): larger slabs, more warps
                dict(BLOCK_N=128, K_SPLIT=256, num_warps=8), dict(BLOCK_N=64, K_SPLIT=512, num_warps=8),
                dict(BLOCK_N=128, K_SPLIT=128, num_warps=4)]
CALLS = 48
ROTATE_BYTES = 200e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/gemv_slab.json")
    p.add_argument("--shapes", default="qkv,o", help=f"from {list(SHAPES)}")
    p.add_argument("--tokens", default="1,2,4")
    p.add_argument("--configs", default="all", help="comma-separated indices into SLAB_CONFIGS, or all")
    args = p.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    configs = SLAB_CONFIGS if args.configs == "all" else [SLAB_CONFIGS[int(i)] for i in args.configs.split(",")]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(2, int(ROTATE_BYTES // (n * k)) + 1)  # >= 200 MB of FP8 (400 MB of bf16) in the cycle
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        qs = [quantize_weight(w) for w in ws]
        b = torch.randn(n, device=dev, dtype=torch.bfloat16)
        tickets = gemv_triton.new_tickets(n, dev)
        for t in tokens:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            sets_bf16 = [(ws[i % copies],) for i in range(CALLS)]
            sets_fp8 = [qs[i % copies] for i in range(CALLS)]
            row = {"shape": name, "n": n, "k": k, "tokens": t, "copies": copies}
            row["cublas_bf16_us"] = graph_time_us(lambda w: F.linear(x, w, b), sets_bf16)[0]
            row["gemv_bf16_us"] = graph_time_us(lambda w: gemv_triton.gemv(x, w, b, tickets), sets_bf16)[0]
            row["fp8_gemv_us"] = graph_time_us(lambda wq, sw: fp8_gemv_triton.fp8_gemv(x, wq, sw, b, tickets), sets_fp8)[0]
            for i, cfg in enumerate(configs):
                for first in (False, True):
                    c = dict(cfg, weights_first=first)
                    tag = f"slab{i}{'w' if first else ''}"
                    wq, sw = qs[0]
                    got = slab_gemv_triton.slab_gemv(x, wq, sw, b, tickets, c).float()
                    want = reference(x, wq, sw, b).float()
                    got16 = slab_gemv_triton.slab_gemv(x, ws[0], None, b, tickets, c).float()
                    want16 = F.linear(x.float(), ws[0].float(), b.float()).bfloat16().float()
                    tol = 2 ** -7 * want.abs().max().item()  # a bf16 rounding step of the largest output
                    row[f"{tag}_err"] = max((got - want).abs().max().item(), (got16 - want16).abs().max().item())
                    if row[f"{tag}_err"] > tol:
                        raise SystemExit(f"{name} T={t} {c}: slab GEMV off its twin by {row[f'{tag}_err']:.3g} > {tol:.3g}")
                    row[f"{tag}_fp8_us"] = graph_time_us(
                        lambda wq, sw: slab_gemv_triton.slab_gemv(x, wq, sw, b, tickets, c), sets_fp8)[0]
                    row[f"{tag}_bf16_us"] = graph_time_us(
                        lambda w: slab_gemv_triton.slab_gemv(x, w, None, b, tickets, c), sets_bf16)[0]
            fp8_best = min((v, key) for key, v in row.items() if key.startswith("slab") and key.endswith("_fp8_us"))
            bf16_best = min((v, key) for key, v in row.items() if key.startswith("slab") and key.endswith("_bf16_us"))
            ref = min(row["cublas_bf16_us"], row["gemv_bf16_us"])
            row.update(slab_fp8_best=fp8_best[1], slab_fp8_best_us=fp8_best[0], slab_bf16_best=bf16_best[1],
                       slab_bf16_best_us=bf16_best[0], slab_fp8_tb_s=n * ((k + 127) // 128 * 128) / fp8_best[0] / 1e6,
                       slab_bf16_tb_s=n * k * 2 / bf16_best[0] / 1e6, fp8_speedup_vs_bf16_now=ref / fp8_best[0],
                       bf16_speedup_vs_bf16_now=ref / bf16_best[0])
            rows.append(row)
            print(" ".join(f"{key}={v:.3g}" if isinstance(v, float) else f"{key}={v}" for key, v in row.items()), flush=True)
            del x
        del ws, qs
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "device": torch.cuda.get_device_name(), "slab_configs": configs,
                                          "calls_per_graph": CALLS, "rows": rows}, indent=1))
    print(f"\n{'shape':5s} {'T':>2s} {'cuBLAS':>7s} {'GEMV':>7s} {'FP8 GEMV':>8s} {'slab FP8':>8s} {'TB/s':>5s} "
          f"{'slab bf16':>9s} {'TB/s':>5s}  best configs (us per call, weights from HBM)")
    for r in rows:
        print(f"{r['shape']:5s} {r['tokens']:2d} {r['cublas_bf16_us']:7.2f} {r['gemv_bf16_us']:7.2f} {r['fp8_gemv_us']:8.2f} "
              f"{r['slab_fp8_best_us']:8.2f} {r['slab_fp8_tb_s']:5.2f} {r['slab_bf16_best_us']:9.2f} {r['slab_bf16_tb_s']:5.2f}"
              f"  {r['slab_fp8_best']} / {r['slab_bf16_best']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
