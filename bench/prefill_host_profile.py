"""Where the host time of one eager prefill forward goes (20b random weights, batch 1).

    python -m bench.prefill_host_profile --tokens 1024 --out bench/results/prefill_host_profile_h200.json

Prints wall time per forward next to the summed GPU kernel time, and the top CPU ops by self time
(torch.profiler, CPU + CUDA activities). If wall >> kernels, the forward is host-bound.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.e2e import Harness
from model.config import GptOssConfig


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--out", default="bench/results/prefill_host_profile.json")
    args = p.parse_args(argv)
    h = Harness(args.model, GptOssConfig.preset(args.model), torch.device("cuda"), 1, args.tokens + 64, 10.0)
    n = args.tokens
    ids = torch.randint(0, h.config.vocab_size, (n,), device="cuda")
    pos = torch.arange(n, device="cuda")
    batch = h.prefill_batch(0, n)

    def forward():
        return h.model.compute_logits(h.model(ids, pos, batch)[-1:]).float().argmax(-1)

    for _ in range(3):
        forward()
    torch.cuda.synchronize()
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        forward()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    top = [{"name": e.key[:80], "calls": e.count, "self_cpu_us": round(e.self_cpu_time_total, 1)} for e in cpu]
    res = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": args.model, "tokens": n,
           "wall_ms": sorted(walls), "gpu_kernel_ms": gpu_us / 1e3, "top_cpu_self": top}
    print(f"wall ms {sorted(walls)}  gpu kernels {gpu_us / 1e3:.2f} ms")
    for t in top:
        print(f"  {t['self_cpu_us']:9.1f} us {t['calls']:5d}x  {t['name']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
