"""Timing for the end-to-end benchmark (bench/e2e.py and the probes built on its Harness): a time budget,
medians of CUDA-event times, times after GPU idle, and the top kernels of one call."""

from __future__ import annotations

import time

import torch


class Clock:
    def __init__(self, budget_s: float):
        self.start, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int = 3) -> float:
    """Median seconds of fn() over `reps` (CUDA events on GPU)."""
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return sorted(out)[len(out) // 2]


def timed_after_rest(fn, device, reps: int = 3, rest_s: float = 0.3) -> float:
    """Median seconds of fn(), each call after `rest_s` of GPU idle: what one request reaching an idle server
    sees. A prefill forward runs at the H200's 700 W cap (bench/power_probe.py: SM clocks ~1,550-1,600 MHz of
    1,980 back to back), so forwards timed back to back (`timed`) are slower than one after a rest."""
    out = []
    for _ in range(reps):
        sync(device)
        time.sleep(rest_s)
        out.append(timed(fn, device, reps=1))
    return sorted(out)[len(out) // 2]


def top_kernels(fn, device, n: int = 6) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    # on the GPU kernels and copies only: a CPU op (aten::mm) also reports the device time of what it launched
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0
              and (device.type != "cuda" or e.device_type == torch.autograd.DeviceType.CUDA)]
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events) or 1.0
    return [{"name": e.key[:90], "us": round(getattr(e, attr), 1), "share": round(getattr(e, attr) / total, 3),
             "calls": e.count} for e in events[:n]]
