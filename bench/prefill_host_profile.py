"""Where the time of one eager prefill forward goes (random weights, batch 1): host and GPU.

    python -m bench.prefill_host_profile --model gpt-oss-20b --tokens 1024,4096 \
        --out bench/results/prefill_host_profile_h200.json

Per token count: wall time per forward (5 runs) next to the summed GPU kernel time; every GPU kernel
(name, launches, total us); the top CPU ops by self time (torch.profiler, CPU + CUDA activities); and
the top Python functions by own time over one forward (cProfile: the launch paths of Triton, DeepGEMM,
FlashInfer and our wrappers). If wall >> kernels, the forward is host-bound.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.e2e import Harness
from model.config import GptOssConfig


def profile_tokens(h: Harness, n: int) -> dict:
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
    # Kernels and copies only: a CPU op (aten::addmm) also reports the device time of what it launched,
    # and summing both counted that time twice (the 2026-11-30 JSONs' gpu_kernel_ms; bench/RESULTS.md has it right).
    device_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    gpu_us = sum(e.self_device_time_total for e in device_events)
    kernels = sorted(device_events, key=lambda e: e.self_device_time_total, reverse=True)
    cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    pr = cProfile.Profile()
    pr.enable()
    forward()
    torch.cuda.synchronize()
    pr.disable()
    stats = pstats.Stats(pr)
    py = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:30]  # (cc, nc, tottime, cumtime, callers)
    return {"tokens": n, "wall_ms": sorted(walls), "gpu_kernel_ms": gpu_us / 1e3,
            "gpu_kernels": [{"name": e.key[:120], "calls": e.count, "us": round(e.self_device_time_total, 1)}
                            for e in kernels],
            "top_cpu_self": [{"name": e.key[:80], "calls": e.count, "self_cpu_us": round(e.self_cpu_time_total, 1)}
                             for e in cpu],
            "top_python_own": [{"function": f"{Path(f).name}:{line}({fn})", "calls": v[1],
                                "own_us": round(v[2] * 1e6, 1), "cum_us": round(v[3] * 1e6, 1)}
                               for (f, line, fn), v in py]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--tokens", default="1024", help="comma list of prompt lengths")
    p.add_argument("--out", default="bench/results/prefill_host_profile.json")
    p.add_argument("--dense-dtype", default="auto", help="QKV / O weights: auto (bf16) or fp8_e4m3")
    args = p.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    h = Harness(args.model, GptOssConfig.preset(args.model), torch.device("cuda"), 1, max(tokens) + 64, 10.0,
                dense_dtype=args.dense_dtype)
    res = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": args.model,
           "dense_dtype": args.dense_dtype, "runs": []}
    for n in tokens:
        r = profile_tokens(h, n)
        res["runs"].append(r)
        print(f"\n{args.model} {n} tokens: wall ms {[round(w, 1) for w in r['wall_ms']]}  gpu kernels "
              f"{r['gpu_kernel_ms']:.2f} ms")
        for k in r["gpu_kernels"][:30]:
            print(f"  {k['us']:9.1f} us {k['calls']:5d}x  {k['name'][:90]}")
        print("  python, own time:")
        for f in r["top_python_own"][:12]:
            print(f"  {f['own_us']:9.1f} us {f['calls']:5d}x  {f['function']}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
