"""Where a graph-replayed decode step's time goes: every kernel inside the CUDA graph on the device timeline.

    python -m bench.decode_timeline --model gpt-oss-20b --batch 1 --out bench/results/decode_timeline_20b_h200.json

bench/decode_ab lists each kernel's duration launched eagerly; inside the replayed graph, under programmatic
dependent launch (kernels/pdl.py), kernels overlap their neighbours' ramps and a small kernel can cost the step
less than its own duration (kernels/attention/NOTES.md, the rotary fold). This replays the step (bench/e2e.Harness,
random weights, synthetic context) under torch.profiler, reads the kernels' start and end times from the trace,
and reports per kernel name: calls, what it adds to the step ("adds": how far each call moves the latest
kernel end so far; a kernel waits for its predecessor, so these sum to the step), its summed duration inside
the graph (waiting at griddepcontrol.wait included), the time it alone occupied the GPU ("exclusive") and the
idle time before it (no kernel running); per step: wall time, busy time, idle time. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.e2e import Harness
from model.config import GptOssConfig


def kernel_spans(trace: dict) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every device kernel in a chrome trace, in start order."""
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace.get("traceEvents", [])
             if e.get("ph") == "X" and e.get("cat") == "kernel"]
    return sorted(spans)


def step_profile(spans: list[tuple[float, float, str]]) -> dict:
    """Per-name and whole-span accounting of overlapping kernel intervals (see the module docstring)."""
    names: dict[str, dict] = defaultdict(lambda: {"calls": 0, "dur_us": 0.0, "adds_us": 0.0, "exclusive_us": 0.0,
                                                  "idle_before_us": 0.0})
    points = sorted({t for s, e, _ in spans for t in (s, e)})
    busy = idle = 0.0
    for a, b in zip(points, points[1:]):  # elementary intervals: who runs there
        running = [n for s, e, n in spans if s <= a and e >= b]
        if not running:
            idle += b - a
            nxt = next((n for s, _, n in spans if s >= b), None)
            if nxt is not None:
                names[nxt]["idle_before_us"] += b - a
            continue
        busy += b - a
        if len(running) == 1:
            names[running[0]]["exclusive_us"] += b - a
    done = spans[0][0] if spans else 0.0
    for s, e, n in spans:
        names[n]["calls"] += 1
        names[n]["dur_us"] += e - s
        # on the chain each kernel waits for its predecessor to complete: what it adds to the step is how far
        # it moves the latest end so far (the sum over kernels is the step's span)
        names[n]["adds_us"] += max(0.0, e - done)
        done = max(done, e)
    wall = spans[-1][1] - spans[0][0] if spans else 0.0
    rows = sorted(({"name": n[:90], **{k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}}
                   for n, r in names.items()), key=lambda r: -r["adds_us"])
    return {"wall_us": round(wall, 1), "busy_us": round(busy, 1), "idle_us": round(idle, 1),
            "kernel_sum_us": round(sum(e - s for s, e, _ in spans), 1), "kernels": len(spans), "by_name": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--steps", type=int, default=5, help="replays profiled; the median step is reported")
    p.add_argument("--headroom-gb", type=float, default=10.0)
    p.add_argument("--dense-dtype", default="auto", help="EngineConfig.dense_dtype (fp8_e4m3: the FP8 QKV / O)")
    p.add_argument("--decode-front", default="auto", choices=("auto", "triton", "cuda"), help="EngineConfig.decode_front")
    p.add_argument("--lm-head-dtype", default="auto", help="EngineConfig.lm_head_dtype")
    p.add_argument("--mxfp4-decode-max-tokens", type=int, default=0, help="EngineConfig.mxfp4_decode_max_tokens")
    p.add_argument("--kv-cache-dtype", default="auto", help="EngineConfig.kv_cache_dtype (fp8_e4m3 holds more sequences)")
    p.add_argument("--moe-segments-max-rows", type=int, default=None,
                   help="EngineConfig.moe_segments_max_rows (default: the kernel's; 0: DeepGEMM's contiguous GEMM)")
    p.add_argument("--out", default="bench/results/decode_timeline.json")
    args = p.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    h = Harness(args.model, GptOssConfig.preset(args.model), device, max(args.batch, 1), args.ctx + 64, args.headroom_gb,
                lm_head_dtype=args.lm_head_dtype, mxfp4_decode_max_tokens=args.mxfp4_decode_max_tokens,
                dense_dtype=args.dense_dtype, decode_front=args.decode_front, kv_cache_dtype=args.kv_cache_dtype,
                moe_segments_max_rows=args.moe_segments_max_rows)
    attn = h.decode_batch(args.batch, args.ctx)
    ids = torch.zeros(args.batch, dtype=torch.long, device=device)
    pos = torch.full((args.batch,), args.ctx, dtype=torch.long, device=device)
    for _ in range(3):
        h.graphs.run(ids, pos, attn)
    torch.cuda.synchronize()
    steps = []
    graph = h.graphs.graphs[h.graphs.bucket_for(args.batch)]  # the inputs stay staged: only the replay is traced
    for _ in range(args.steps):  # one replay per trace, the GPU idle in between: a step's spans stay apart
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            steps.append(step_profile(kernel_spans(json.loads(Path(f.name).read_text()))))
        time.sleep(0.01)
    steps.sort(key=lambda s: s["wall_us"])
    med = steps[len(steps) // 2]
    print(f"{args.model} b={args.batch} ctx {args.ctx}: replayed step {med['wall_us']:.1f} us on the device timeline, "
          f"busy {med['busy_us']:.1f}, idle {med['idle_us']:.1f}, kernel durations summed {med['kernel_sum_us']:.1f} "
          f"({med['kernels']} kernels); walls of the {len(steps)} replays {[s['wall_us'] for s in steps]}")
    print(f"{'kernel':60s} {'calls':>5s} {'adds us':>8s} {'in graph us':>11s} {'exclusive':>9s} {'idle before':>11s}")
    for r in med["by_name"][:20]:
        print(f"{r['name'][:60]:60s} {r['calls']:5d} {r['adds_us']:8.1f} {r['dur_us']:11.1f} {r['exclusive_us']:9.1f} "
              f"{r['idle_before_us']:11.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "device": torch.cuda.get_device_name(), "args": vars(args), "median_step": med,
                               "steps": steps}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
