"""Where one prefill forward's time goes on the device timeline: kernels, the GPU's idle gaps, and who was late.

    python -m bench.prefill_timeline --model gpt-oss-20b --tokens 1024,4096 --out bench/results/prefill_timeline_20b.json

bench/prefill_host_profile sums kernel durations and host time; it cannot say whether the GPU waited for the host.
This runs the prefill forward as bench/e2e times it (Harness.prefill_runner: the piecewise prefill graphs with
attention eager between them; --no-prefill-graphs for the eager forward), traces it with torch.profiler (CUDA
activity only, so the host runs as untraced as CUPTI lets it), and reports per token count: the wall time (CUDA
events around the forward, untraced), the device span (first kernel start to last end), busy and idle time, what
each kernel name adds to the span (bench/decode_timeline.step_profile), and every idle gap with the host's launch
of the work after it. A gap whose launch call (kernel launch, graph launch or copy) started after the GPU went idle
is host-bound for that long ("host late"); the rest of a gap is the device's (graph launch latency, a copy's
queueing). Gaps are summed by the kernel after them and by the host call that launched it. With --stacks a
further forward is traced with Python stacks (CPU activity: slower, its times are not the measurement) to name
the project function that launched the work after each host-bound gap.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.decode_timeline import step_profile

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
PROJECT_DIRS = ("engine/", "kernels/", "model/", "bench/")


def device_spans(trace: dict) -> list[tuple[float, float, str, int | None]]:
    """(start us, end us, name, correlation id) of every kernel, copy and memset on the device, in start order."""
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"], (e.get("args") or {}).get("correlation"))
             for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    return sorted(spans, key=lambda s: (s[0], s[1]))


def launch_calls(trace: dict) -> dict[int, tuple[float, str, int | None]]:
    """Correlation id -> (start us, name, host thread) of the API call that put that work on the device."""
    out = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                out[corr] = (e["ts"], e["name"], e.get("tid"))
    return out


def idle_gaps(spans: list[tuple[float, float, str, int | None]], launches: dict[int, tuple[float, str, int | None]],
              min_us: float = 0.5) -> list[dict]:
    """Every stretch of at least min_us with nothing on the device, between the first span and the last.
    Per gap: where it starts, how long, the span that ended last before it and the one after it, the host call
    that launched the one after, and how much of the gap the host is to blame for: from the gap's start to that
    call's start (clamped to the gap), zero when the call came before the device went idle."""
    gaps = []
    done, last = None, None
    for start, end, name, corr in spans:
        if done is not None and start - done >= min_us:
            call = launches.get(corr)
            host = min(max(call[0] - done, 0.0), start - done) if call is not None else 0.0
            gaps.append({"at_us": done, "us": start - done, "before": last, "after": name,
                         "launch": call[1] if call is not None else None, "host_us": host,
                         "device_us": start - done - host, "launch_ts": call[0] if call is not None else None,
                         "launch_tid": call[2] if call is not None else None})
        if done is None or end > done:
            done, last = end, name
    return gaps


def gap_summary(gaps: list[dict], key: str = "after", top: int = 12) -> list[dict]:
    """Gaps summed by the kernel after them (key="after") or by the launching call (key="launch"), largest first."""
    rows: dict[str, dict] = defaultdict(lambda: {"gaps": 0, "us": 0.0, "host_us": 0.0})
    for g in gaps:
        r = rows[str(g[key])[:90]]
        r["gaps"] += 1
        r["us"] += g["us"]
        r["host_us"] += g["host_us"]
    out = [{key: k, "gaps": r["gaps"], "us": round(r["us"], 1), "host_us": round(r["host_us"], 1)}
           for k, r in rows.items()]
    return sorted(out, key=lambda r: -r["us"])[:top]


def forward_timeline(trace: dict, min_gap_us: float = 0.5) -> dict:
    """One traced forward: step_profile's accounting plus its idle gaps, attributed."""
    spans = device_spans(trace)
    prof = step_profile([(s, e, n) for s, e, n, _ in spans])
    gaps = idle_gaps(spans, launch_calls(trace), min_gap_us)
    idle = sum(g["us"] for g in gaps)
    host = sum(g["host_us"] for g in gaps)
    return {**prof, "gaps": len(gaps), "gap_us": round(idle, 1), "gap_host_us": round(host, 1),
            "gap_device_us": round(idle - host, 1), "gaps_by_next": gap_summary(gaps, "after"),
            "gaps_by_launch": gap_summary(gaps, "launch"),
            "largest_gaps": [{k: round(v, 1) if isinstance(v, float) else v for k, v in g.items()}
                             for g in sorted(gaps, key=lambda g: -g["us"])[:10]]}


def launching_functions(trace: dict, gaps: list[dict], top: int = 12) -> list[dict]:
    """For the host-bound gaps of a trace with Python stacks: the innermost project function (PROJECT_DIRS) on
    the launching thread when the late launch call began, with the host-late time summed per function."""
    frames = [(e["ts"], e["ts"] + e["dur"], e.get("tid"), e["name"]) for e in trace.get("traceEvents", [])
              if e.get("ph") == "X" and e.get("cat") == "python_function"
              and any(d in e.get("name", "") for d in PROJECT_DIRS)]
    rows: dict[str, dict] = defaultdict(lambda: {"gaps": 0, "host_us": 0.0})
    for g in gaps:
        if g["host_us"] <= 0 or g["launch_ts"] is None:
            continue
        ts, tid = g["launch_ts"], g["launch_tid"]
        inside = [f for f in frames if f[0] <= ts <= f[1] and f[2] == tid]
        name = min(inside, key=lambda f: f[1] - f[0])[3] if inside else "(no project frame)"
        rows[name]["gaps"] += 1
        rows[name]["host_us"] += g["host_us"]
    out = [{"function": k, "gaps": r["gaps"], "host_us": round(r["host_us"], 1)} for k, r in rows.items()]
    return sorted(out, key=lambda r: -r["host_us"])[:top]


def _trace(fn, activities, with_stack: bool = False) -> dict:
    from torch.profiler import profile

    with profile(activities=activities, with_stack=with_stack) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return json.loads(Path(f.name).read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--chunk", type=int, default=8192, help="longest prefill forward, as bench.e2e --prefill-chunk")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--traces", type=int, default=3, help="traced forwards per token count; the median span is kept")
    p.add_argument("--min-gap-us", type=float, default=0.5)
    p.add_argument("--stacks", action="store_true", help="also name the functions behind host-bound gaps")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--headroom-gb", type=float, default=10.0)
    p.add_argument("--out", default="bench/results/prefill_timeline.json")
    args = p.parse_args(argv)
    from torch.profiler import ProfilerActivity

    from bench.e2e import Harness
    from bench.e2e_timing import timed
    from model.config import GptOssConfig

    lens = [int(t) for t in args.tokens.split(",")]
    device = torch.device("cuda")
    h = Harness(args.model, GptOssConfig.preset(args.model), device, 1, max(lens) + 64, args.headroom_gb,
                kv_cache_dtype=args.kv_cache_dtype)
    capture = None
    if args.prefill_graphs:
        capture = h.capture_prefill_graphs(sorted({min(args.chunk, n - s) for n in lens for s in range(0, n, args.chunk)}))
    results = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": torch.cuda.get_device_name(),
               "args": vars(args), "build_s": h.build_s, "prefill_graph_capture_s": capture, "points": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for n in lens:
        run, chunks = h.prefill_runner(n, args.chunk)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        walls = [round(timed(run, device, reps=1) * 1e3, 3) for _ in range(5)]
        traced = []
        for _ in range(args.traces):
            traced.append(forward_timeline(_trace(run, [ProfilerActivity.CUDA]), args.min_gap_us))
            time.sleep(0.01)
        traced.sort(key=lambda t: t["wall_us"])
        med = traced[len(traced) // 2]
        point = {"tokens": n, "chunks": chunks, "wall_ms": walls, "wall_ms_median": sorted(walls)[len(walls) // 2],
                 "span_us_traced": [t["wall_us"] for t in traced], "median_trace": med}
        if args.stacks:
            trace = _trace(run, [ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True)
            gaps = idle_gaps(device_spans(trace), launch_calls(trace), args.min_gap_us)
            point["stacks"] = {"gap_us": round(sum(g["us"] for g in gaps), 1),
                               "gap_host_us": round(sum(g["host_us"] for g in gaps), 1),
                               "by_function": launching_functions(trace, gaps)}
        results["points"].append(point)
        out.write_text(json.dumps(results, indent=1))
        print(f"\n{args.model} prefill {n} tokens ({chunks} chunk{'s' if chunks > 1 else ''}, "
              f"{'prefill graphs' if args.prefill_graphs else 'eager'}): wall {point['wall_ms_median']:.2f} ms "
              f"(CUDA events, untraced: {walls}); traced device span {med['wall_us'] / 1e3:.2f} ms, busy "
              f"{med['busy_us'] / 1e3:.2f}, idle {med['idle_us'] / 1e3:.2f} in {med['gaps']} gaps: host late "
              f"{med['gap_host_us'] / 1e3:.2f} ms, device {med['gap_device_us'] / 1e3:.2f} ms; {med['kernels']} kernels")
        print(f"  {'idle before':60s} {'gaps':>5s} {'us':>8s} {'host late':>9s}")
        for r in med["gaps_by_next"][:8]:
            print(f"  {r['after'][:60]:60s} {r['gaps']:5d} {r['us']:8.1f} {r['host_us']:9.1f}")
        print(f"  {'launched by':60s} {'gaps':>5s} {'us':>8s} {'host late':>9s}")
        for r in med["gaps_by_launch"][:5]:
            print(f"  {str(r['launch'])[:60]:60s} {r['gaps']:5d} {r['us']:8.1f} {r['host_us']:9.1f}")
        print(f"  {'kernel':60s} {'calls':>5s} {'adds us':>9s} {'dur us':>9s}")
        for r in med["by_name"][:12]:
            print(f"  {r['name'][:60]:60s} {r['calls']:5d} {r['adds_us']:9.1f} {r['dur_us']:9.1f}")
        if args.stacks:
            print("  host-late time by the project function launching the next work (stack trace, inflated):")
            for r in point["stacks"]["by_function"][:8]:
                print(f"    {r['function'][:80]:80s} {r['gaps']:5d} {r['host_us']:9.1f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
