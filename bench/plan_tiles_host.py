"""Host time of the sliding-window prefill plan (`plan_tiles`) against its loop twin, per step shape.

    python -m bench.plan_tiles_host --out bench/results/plan_tiles_host.json

The plan runs on the host once per prefill or mixed step (kernels/attention/flashinfer_backend.py); this times
it on this machine's CPU (best of 5 runs of N calls, CPU tensors, so no device copy), beside the twin's lists
packed the way the plan packed them before it was vectorized. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from kernels.attention.reference import sliding_tile_lists
from kernels.attention.sliding_prefill_triton import plan_tiles

SHAPES = {"one 1k prompt": [1024], "one 8k prompt": [8192], "16 x 512": [512] * 16,
          "256 one-query rows": [1] * 256, "4 x 2k + 200 one-query rows": [2048] * 4 + [1] * 200,
          "512 one-query rows": [1] * 512}


def loop_plan(query_lens: list[int], block_m: int) -> torch.Tensor:
    """The twin's lists packed into one int32 tensor, each list padded to 4 entries (the plan's layout)."""
    flat: list[int] = []
    for part in sliding_tile_lists(query_lens, block_m):
        flat += part + [0] * (-len(part) % 4)
    return torch.tensor(flat, dtype=torch.int32)


def best_us(fn, calls: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block-m", type=int, default=16)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out", default="bench/results/plan_tiles_host.json")
    args = p.parse_args(argv)
    rows = []
    table = torch.zeros(1, 1, dtype=torch.int32)
    for name, lens in SHAPES.items():
        loop = best_us(lambda: loop_plan(lens, args.block_m), args.calls)
        plan = best_us(lambda: plan_tiles(lens, table, table, args.block_m), args.calls)
        rows.append({"shape": name, "sequences": len(lens), "tokens": sum(lens), "loop_us": round(loop, 1),
                     "plan_tiles_us": round(plan, 1), "ratio": round(loop / plan, 2)})
    print(f"{'step':30s} {'loop us':>9s} {'plan_tiles us':>14s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['shape']:30s} {r['loop_us']:9.1f} {r['plan_tiles_us']:14.1f} {r['ratio']:6.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu": platform.processor()
                               or platform.machine(), "block_m": args.block_m, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
