"""Does `cp.async.bulk.prefetch.L2` (kernels/l2_prefetch.py) put a decode weight into L2? One process:

    python -m bench.l2_prefetch_probe [--out bench/results/l2_prefetch_probe_h200.json]

Per weight shape (the 20b QKV and O projections, one FP8 expert's gate_up + down): flush L2 (write
256 MB), then time one F.linear at T=1 with CUDA events (a) straight away (cold), (b) after the prefetch
kernel, a ~50 us spin and a synchronize (warm by prefetch), (c) right after another F.linear on the same weight (warm
by use, the ceiling). Median of 20 of each. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import triton

from kernels import l2_prefetch

SHAPES = {"qkv 5120x2880 bf16": (5120, 2880), "o 2880x4096 bf16": (2880, 4096), "down 2880x2944 x2 bf16": (5888, 2880)}


def prefetch_now(w: torch.Tensor, sink: torch.Tensor) -> None:
    flat = w.view(-1).view(torch.uint8)
    nbytes = flat.numel() // 16 * 16
    grid = (triton.cdiv(triton.cdiv(nbytes, l2_prefetch.CHUNK), l2_prefetch.CHUNKS_PER_PROGRAM),)
    l2_prefetch._prefetch_kernel[grid](flat, nbytes, sink, CHUNK=l2_prefetch.CHUNK, PER=l2_prefetch.CHUNKS_PER_PROGRAM,
                                       num_warps=1)


def timed_linear(x, w) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.nn.functional.linear(x, w)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="bench/results/l2_prefetch_probe.json")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    sink = torch.zeros(4096, dtype=torch.int32, device=dev)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        cold, pre, warm, pre_only = [], [], [], []
        for _ in range(args.reps + 2):
            flush.fill_(1)
            torch.cuda.synchronize()
            cold.append(timed_linear(x, w))
            flush.fill_(2)
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            prefetch_now(w, sink)
            e.record()
            torch.cuda._sleep(100_000)  # ~50 us: the prefetches are asynchronous to the kernel that issued them
            torch.cuda.synchronize()
            pre_only.append(s.elapsed_time(e) * 1e3)
            pre.append(timed_linear(x, w))
            warm.append(timed_linear(x, w))
        med = [statistics.median(v[2:]) for v in (cold, pre, warm, pre_only)]
        mb = n * k * 2 / 1e6
        rows.append({"shape": name, "mb": mb, "cold_us": med[0], "prefetched_us": med[1], "warm_us": med[2],
                     "prefetch_kernel_us": med[3]})
    print(f"{'weight':24s} {'MB':>6s} {'cold us':>8s} {'after prefetch':>15s} {'warm (2nd use)':>15s} {'prefetch us':>12s}")
    for r in rows:
        print(f"{r['shape']:24s} {r['mb']:6.1f} {r['cold_us']:8.1f} {r['prefetched_us']:15.1f} {r['warm_us']:15.1f} "
              f"{r['prefetch_kernel_us']:12.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
