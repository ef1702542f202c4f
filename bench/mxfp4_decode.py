"""The MXFP4 decode grouped GEMM (kernels/moe/mxfp4_decode_gemm.py) against the FP8 decode GEMM it would
replace, on gpt-oss expert shapes: gate_up [2I=5760, D=2880]
and down [D, I], active experts of T tokens x top-4 out of 32 (20b) or 128 (120b), T = 1, 4, 16, 64.
First a config sweep at T = 1 (20b shapes), then the table with the best config.

    python -m bench.mxfp4_decode --out bench/results/mxfp4_decode_h200.json

Each GEMM captured 50 times in one CUDA graph and the replay timed; prints us per call, the weight
bytes each streams and GB/s, and the MXFP4 result's difference from its dequantize-to-bf16 twin.
The 2026-11-30 runs (`bench/results/mxfp4_decode*_h200.json`) also timed two earlier unpacks, since removed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.moe_common import calc_diff, graph_us
from kernels.moe import mxfp4_decode_gemm as mx
from kernels.moe import triton_grouped_gemm as tgg
from kernels.moe.epilogues_triton import Fp8Rows, dispatch_quant
from kernels.moe.fp8_quant import padded, quantize_weight_blocks
from kernels.moe.routing_triton import plan_masked
from model.mxfp4 import quantize_mxfp4

D = I = 2880
TOP_K = 4


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/mxfp4_decode.json")
    p.add_argument("--tokens", default="1,4,16,64")
    p.add_argument("--sweep", default="BLOCK_N=64,128;num_stages=2,3,4;splits=2,4,8")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    rows, log = [], []
    best = {}
    for experts in (32, 128):
        for name, (n, k) in {"gate_up": (2 * I, D), "down": (D, I)}.items():
            dense = torch.randn(experts, n, k, device=dev) * k ** -0.5
            parts = [quantize_mxfp4(dense[e:e + 1]) for e in range(experts)]  # per expert: bounded memory
            blocks = torch.cat([b for b, _ in parts]).view(experts, n, k // 32, 16)
            scales = torch.cat([s for _, s in parts])
            del parts
            w8, s8 = quantize_weight_blocks(dense, padded(k))
            del dense
            pre = mx.pack_prescaled_words(blocks, scales)
            if experts == 32 and args.sweep:
                best[name] = sweep(name, n, k, experts, dev, args.sweep, log, lambda a16, out, plan, rmap, cfg:
                                   mx.grouped_gemm_decode_mxfp4_prescaled(a16, pre, out, plan.counts, plan.active,
                                                                          plan.num_active, 1, 1, a_row_map=rmap,
                                                                          config=cfg))
            for t in [int(x) for x in args.tokens.split(",")]:
                x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
                ids = torch.stack([torch.randperm(experts, device=dev)[:TOP_K] for _ in range(t)]).int()
                plan = plan_masked(ids, 0, experts, t)
                active = int(plan.num_active)
                splits = tgg.decode_splits(t)
                shape = (splits, experts * t, n) if splits > 1 else (experts * t, n)
                dtype = torch.float32 if splits > 1 else torch.bfloat16
                a_bf16 = torch.zeros(experts * t, k, device=dev, dtype=torch.bfloat16)
                a_bf16[plan.row_of_pair.long()] = x[torch.arange(t * TOP_K, device=dev) // TOP_K]
                a8 = dispatch_quant(x, plan.row_of_pair, TOP_K, Fp8Rows.empty(experts, t, padded(k), dev))
                out_8 = torch.empty(shape, device=dev, dtype=dtype)
                cfg = dict(best.get(name, {}))
                p_splits = cfg.pop("splits", splits) if t <= 4 else 1
                p_shape = (p_splits, experts * t, n) if p_splits > 1 else (experts * t, n)
                out_p = torch.empty(p_shape, device=dev, dtype=torch.float32 if p_splits > 1 else torch.bfloat16)
                a16 = a_bf16.half()

                def run_mx():
                    mx.grouped_gemm_decode_mxfp4_prescaled(a16, pre, out_p, plan.counts, plan.active,
                                                           plan.num_active, t, t, config=cfg)

                def run_fp8():
                    tgg.grouped_gemm_decode(a8, w8, s8, out_8, plan.counts, plan.active, plan.num_active, t)

                row = {"experts": experts, "gemm": name, "tokens": t, "active": active,
                       "mxfp4_us": graph_us(run_mx), "fp8_us": graph_us(run_fp8), "config": dict(cfg, splits=p_splits),
                       "inexact_groups": pre["inexact_groups"],
                       "mxfp4_bytes": active * n * k * 17 // 32, "fp8_bytes": active * n * padded(k)}
                row["mxfp4_gb_s"] = row["mxfp4_bytes"] / row["mxfp4_us"] / 1e3
                row["fp8_gb_s"] = row["fp8_bytes"] / row["fp8_us"] / 1e3
                got = out_p.sum(0) if p_splits > 1 else out_p.float()
                want = mx.reference_decode_mxfp4(a_bf16, blocks, scales, plan.counts, t)
                r = plan.row_of_pair.long()
                row["mxfp4_diff"] = calc_diff(got[r], want[r])
                rows.append(row)
                print(" ".join(f"{k_}={v:.3g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()),
                      flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "device": torch.cuda.get_device_name(), "sweep": log, "best": best,
                                          "rows": rows}, indent=1))
    return 0


def sweep(name, n, k, experts, dev, spec, log, run) -> dict:
    """Time run(a16, out, plan, row_map, config) at T = 1 over the grid in `spec` ("key=v,v;key=v,...");
    returns the fastest config (with its "splits")."""
    grid = [dict()]
    for part in spec.split(";"):
        key, values = part.split("=")
        grid = [dict(g, **{key: int(v)}) for g in grid for v in values.split(",")]
    ids = torch.randperm(experts, device=dev)[:TOP_K][None].int()
    plan = plan_masked(ids, 0, experts, 1)
    a16 = torch.randn(1, k, device=dev).half()
    row_map = torch.zeros(experts, dtype=torch.int32, device=dev)
    best, best_us = {}, float("inf")
    for cfg in grid:
        cfg = dict(cfg)
        s = cfg.pop("splits")
        out = torch.empty(s, experts, n, device=dev)
        try:
            us = graph_us(lambda: run(a16, out, plan, row_map, cfg))
        except Exception as exc:  # a config that does not compile (shared memory) is recorded, not fatal
            log.append(dict(gemm=name, **cfg, splits=s, error=str(exc).splitlines()[0][:160]))
            print(f"sweep {name} {cfg} splits={s}: {str(exc).splitlines()[0][:160]}", flush=True)
            continue
        log.append(dict(gemm=name, **cfg, splits=s, us=us))
        print(f"sweep {name} {cfg} splits={s}: {us:.1f} us", flush=True)
        if us < best_us:
            best, best_us = dict(cfg, splits=s), us
    return best


if __name__ == "__main__":
    raise SystemExit(main())
