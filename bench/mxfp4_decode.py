"""MXFP4 decode grouped GEMM (kernels/moe/mxfp4_decode_gemm.py) against the FP8 decode GEMM it would
replace, on gpt-oss expert shapes: gate_up [2I=5760, D=2880] and down [D, I], active experts of T tokens
x top-4 out of 32 (20b) or 128 (120b), T = 1, 4, 16, 64.

    python -m bench.mxfp4_decode --out bench/results/mxfp4_decode_h200.json

Each GEMM captured 50 times in one CUDA graph and the replay timed; prints us per call, the weight
bytes each streams and GB/s, and the MXFP4 result's difference from its dequantize-to-bf16 twin.
Not yet run (written 2026-11-30 without device time left).
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
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for experts in (32, 128):
        for name, (n, k) in {"gate_up": (2 * I, D), "down": (D, I)}.items():
            dense = torch.randn(experts, n, k, device=dev) * k ** -0.5
            parts = [quantize_mxfp4(dense[e:e + 1]) for e in range(experts)]  # per expert: bounded memory
            blocks = torch.cat([b for b, _ in parts]).view(experts, n, k // 32, 16)
            scales = torch.cat([s for _, s in parts])
            del parts
            w8, s8 = quantize_weight_blocks(dense, padded(k))
            del dense
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
                out_mx = torch.empty(shape, device=dev, dtype=dtype)
                out_8 = torch.empty(shape, device=dev, dtype=dtype)

                def run_mx():
                    mx.grouped_gemm_decode_mxfp4(a_bf16, blocks, scales, out_mx, plan.counts, plan.active,
                                                 plan.num_active, t, t)

                def run_fp8():
                    tgg.grouped_gemm_decode(a8, w8, s8, out_8, plan.counts, plan.active, plan.num_active, t)

                row = {"experts": experts, "gemm": name, "tokens": t, "active": active,
                       "mxfp4_us": graph_us(run_mx), "fp8_us": graph_us(run_fp8),
                       "mxfp4_bytes": active * n * k * 17 // 32, "fp8_bytes": active * n * padded(k)}
                row["mxfp4_gb_s"] = row["mxfp4_bytes"] / row["mxfp4_us"] / 1e3
                row["fp8_gb_s"] = row["fp8_bytes"] / row["fp8_us"] / 1e3
                got = out_mx.sum(0) if splits > 1 else out_mx.float()
                want = mx.reference_decode_mxfp4(a_bf16, blocks, scales, plan.counts, t)
                r = plan.row_of_pair.long()
                row["mxfp4_diff"] = calc_diff(got[r], want[r])
                rows.append(row)
                print(" ".join(f"{k_}={v:.3g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()),
                      flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
