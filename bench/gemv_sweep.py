"""Decode GEMV (kernels/layers/gemv_triton.py) against cuBLAS (F.linear) on gpt-oss's QKV and O shapes.

    python -m bench.gemv_sweep --out bench/results/gemv_h200.json

Each call captured 50 times in one CUDA graph, replay timed (launch gaps included, as in the decode
step); us per call and weight-stream TB/s, T = 1, 4, 16, several configs.
Timing: bench/moe_common.graph_us (triton do_bench median over graph replays); the committed
bench/results/gemv_h200.json was timed with CUDA events, median of 5 replays, over the same graph.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.moe_common import graph_us
from kernels.layers import gemv_triton

SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096)}
CONFIGS = [dict(BLOCK_N=64, BLOCK_K=128, waves=2, num_stages=4), dict(BLOCK_N=64, BLOCK_K=256, waves=2, num_stages=3),
           dict(BLOCK_N=32, BLOCK_K=256, waves=2, num_stages=3), dict(BLOCK_N=64, BLOCK_K=128, waves=4, num_stages=4),
           dict(BLOCK_N=128, BLOCK_K=128, waves=2, num_stages=4), dict(BLOCK_N=64, BLOCK_K=256, waves=1, num_stages=4)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/gemv.json")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        b = torch.randn(n, device=dev, dtype=torch.bfloat16)
        tickets = gemv_triton.new_tickets(n, dev)
        for t in (1, 4, 16):
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            row = {"shape": name, "n": n, "k": k, "tokens": t, "cublas_us": graph_us(lambda: F.linear(x, w, b))}
            for i, cfg in enumerate(CONFIGS):
                row[f"cfg{i}_us"] = graph_us(lambda: gemv_triton.gemv(x, w, b, tickets, cfg))
            best = min((v, key) for key, v in row.items() if key.startswith("cfg"))
            row["best"] = best[1]
            row["best_tb_s"] = n * k * 2 / (best[0] * 1e-6) / 1e12
            row["cublas_tb_s"] = n * k * 2 / (row["cublas_us"] * 1e-6) / 1e12
            rows.append(row)
            print(" ".join(f"{key}={v:.2f}" if isinstance(v, float) else f"{key}={v}" for key, v in row.items()), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "device": torch.cuda.get_device_name(), "configs": CONFIGS, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
