"""Clocks and power while a workload runs: is the GPU power-capped, and does rest between forwards make one faster?

    python -m bench.power_probe --model gpt-oss-20b --prefill 1024,4096 --decode 1,64 --out bench/results/power_probe.json

Per workload (a prefill forward of N tokens as bench/e2e runs it, through the prefill graphs; a decode step at
batch B and context --ctx, its CUDA graph replayed):
- back-to-back: forwards for --seconds while `nvidia-smi -lms` samples the SM and memory clocks, the power draw,
  the temperature and the active clock-event (throttle) reasons; each forward timed with CUDA events; the mean
  of the first and of the last five forwards, and per sample the share with each reason set (sw_power_cap: the
  driver lowered clocks to hold the power limit);
- isolated: --isolated forwards, each after --rest-ms of GPU idle (what one request's TTFT sees): median wall.
If back-to-back forwards run at the power cap below the top SM clock while isolated ones are faster, the
workload is power-bound: removing idle time inside a forward cannot shorten it, only less work (bytes, FLOPs)
can. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

# NVML's clock-event reason bits (nvmlClocksEventReasons; nvidia-smi prints them as one hex mask)
REASONS = {0x1: "gpu_idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
           0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}
FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")


def parse_samples(text: str) -> list[dict]:
    """Rows of `nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,<reasons>
    --format=csv,noheader,nounits`; rows that do not parse (a field the driver reports as N/A) are dropped."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(FIELDS) + 1:
            continue
        try:
            sm, mem, power, temp = (float(p) for p in parts[:4])
            mask = int(parts[4], 16)
        except ValueError:
            continue
        rows.append({"sm_mhz": sm, "mem_mhz": mem, "power_w": power, "temp_c": temp, "reasons": mask})
    return rows


def summarize(samples: list[dict]) -> dict:
    """Means, extremes and the share of samples with each clock-event reason set."""
    if not samples:
        return {"samples": 0}
    n = len(samples)
    out = {"samples": n}
    for key in ("sm_mhz", "mem_mhz", "power_w", "temp_c"):
        vals = [s[key] for s in samples]
        out[key] = {"mean": round(sum(vals) / n, 1), "min": min(vals), "max": max(vals)}
    out["reasons"] = {name: round(sum(1 for s in samples if s["reasons"] & bit) / n, 3)
                      for bit, name in REASONS.items() if any(s["reasons"] & bit for s in samples)}
    return out


class ClockSampler:
    """nvidia-smi sampling one GPU every `period_ms` between start() and stop()."""

    def __init__(self, gpu: str, period_ms: int = 20):
        self.gpu, self.period_ms, self.proc, self.reason_field = gpu, period_ms, None, None
        for field in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):  # newer, older drivers
            probe = subprocess.run(["nvidia-smi", "-i", gpu, f"--query-gpu={field}", "--format=csv,noheader"],
                                   capture_output=True, text=True)
            if probe.returncode == 0 and probe.stdout.strip().startswith("0x"):
                self.reason_field = field
                break
        if self.reason_field is None:
            raise RuntimeError(f"nvidia-smi reports no clock-event reasons for GPU {gpu}")

    def start(self) -> None:
        query = ",".join(FIELDS + (self.reason_field,))
        self.proc = subprocess.Popen(["nvidia-smi", "-i", self.gpu, f"--query-gpu={query}",
                                      "--format=csv,noheader,nounits", "-lms", str(self.period_ms)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop(self) -> list[dict]:
        self.proc.terminate()
        text, _ = self.proc.communicate(timeout=10)
        return parse_samples(text)


def gpu_limits(gpu: str) -> dict:
    probe = subprocess.run(["nvidia-smi", "-i", gpu, "--query-gpu=name,power.limit,clocks.max.sm,clocks.max.mem",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True)
    parts = [p.strip() for p in probe.stdout.strip().split(",")]
    return {"name": parts[0], "power_limit_w": parts[1], "max_sm_mhz": parts[2], "max_mem_mhz": parts[3]} \
        if len(parts) == 4 else {"raw": probe.stdout.strip()}


def _gpu_id() -> str:
    uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else "0"


def back_to_back(fn, sampler: ClockSampler, seconds: float) -> dict:
    events = []
    sampler.start()
    time.sleep(0.1)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        events.append((a, b))
        if len(events) % 8 == 0:
            events[-1][1].synchronize()  # keep the host at most a few forwards ahead
    torch.cuda.synchronize()
    samples = sampler.stop()
    ms = [a.elapsed_time(b) for a, b in events]
    k = min(5, len(ms))
    return {"forwards": len(ms), "ms_first5": round(sum(ms[:k]) / k, 3), "ms_last5": round(sum(ms[-k:]) / k, 3),
            "ms_median": round(sorted(ms)[len(ms) // 2], 3), "clocks": summarize(samples)}


def isolated(fn, reps: int, rest_ms: float) -> dict:
    from bench.e2e_timing import timed_after_rest

    device = torch.device("cuda")
    ms = [timed_after_rest(fn, device, reps=1, rest_s=rest_ms / 1e3) * 1e3 for _ in range(reps)]
    return {"reps": reps, "rest_ms": rest_ms, "ms_median": round(sorted(ms)[len(ms) // 2], 3),
            "ms_min": round(min(ms), 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--prefill", default="1024,4096", help="prefill token counts ('' for none)")
    p.add_argument("--decode", default="1,64", help="decode batch sizes ('' for none)")
    p.add_argument("--ctx", type=int, default=8192, help="decode context")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--isolated", type=int, default=7)
    p.add_argument("--rest-ms", type=float, default=300.0)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--headroom-gb", type=float, default=10.0)
    p.add_argument("--out", default="bench/results/power_probe.json")
    args = p.parse_args(argv)
    from bench.e2e import Harness
    from model.config import GptOssConfig

    prefill = [int(t) for t in args.prefill.split(",") if t]
    decode = [int(b) for b in args.decode.split(",") if b]
    gpu = _gpu_id()
    sampler = ClockSampler(gpu)
    h = Harness(args.model, GptOssConfig.preset(args.model), torch.device("cuda"), max(decode + [1]),
                max(prefill + [args.ctx]) + 64, args.headroom_gb, kv_cache_dtype=args.kv_cache_dtype)
    if prefill:
        h.capture_prefill_graphs(prefill)
    results = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": gpu_limits(gpu),
               "reason_field": sampler.reason_field, "args": vars(args), "points": []}
    sampler.start()
    time.sleep(1.0)
    results["idle_clocks"] = summarize(sampler.stop())
    work = [("prefill", n) for n in prefill] + [("decode", b) for b in decode]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for kind, n in work:
        if kind == "prefill":
            fn, _ = h.prefill_runner(n, max(prefill))
        else:
            attn = h.decode_batch(n, args.ctx)
            ids = torch.zeros(n, dtype=torch.long, device="cuda")
            pos = torch.full((n,), args.ctx, dtype=torch.long, device="cuda")
            h.graphs.run(ids, pos, attn)  # stages the step's inputs; the replays below reuse them
            fn = h.graphs.graphs[h.graphs.bucket_for(n)].replay
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        point = {"kind": kind, "n": n, "isolated": isolated(fn, args.isolated, args.rest_ms),
                 "back_to_back": back_to_back(fn, sampler, args.seconds)}
        results["points"].append(point)
        out.write_text(json.dumps(results, indent=1))
    print(f"{args.model} on {results['gpu']} (idle: {results['idle_clocks']})")
    print(f"{'workload':16s} {'isolated ms':>11s} {'b2b ms':>8s} {'first5':>8s} {'last5':>8s} {'SM MHz':>12s} "
          f"{'power W':>12s} {'temp':>5s}  reasons (share of samples)")
    for pt in results["points"]:
        b, c = pt["back_to_back"], pt["back_to_back"]["clocks"]
        name = f"{pt['kind']} {pt['n']}" + (f" ctx {args.ctx}" if pt["kind"] == "decode" else "")
        sm = f"{c['sm_mhz']['mean']:.0f} ({c['sm_mhz']['min']:.0f})" if c["samples"] else "-"
        pw = f"{c['power_w']['mean']:.0f} ({c['power_w']['max']:.0f})" if c["samples"] else "-"
        temp = f"{c['temp_c']['max']:.0f}" if c["samples"] else "-"
        print(f"{name:16s} {pt['isolated']['ms_median']:11.3f} {b['ms_median']:8.3f} {b['ms_first5']:8.3f} "
              f"{b['ms_last5']:8.3f} {sm:>12s} {pw:>12s} {temp:>5s}  {c.get('reasons', {})}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
