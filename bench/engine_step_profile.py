"""Where a decode step's time goes outside its CUDA graph: the device work the engine queues between replays.

    python -m bench.engine_step_profile --model gpt-oss-20b --dense-dtype fp8_e4m3 --lm-head-dtype fp8_e4m3 \
        --mxfp4-decode-max-tokens 8 --out bench/results/engine_step_profile_20b_h200.json

bench/e2e's "engine run b1" (one request, LLMEngine.step, lookahead on) measured 1.715 ms per token for 20b against
a replayed graph step of 1.689 ms at ctx 1k (2026-12-03). With the lookahead the host runs ahead of the GPU, so what
separates the two is device work on the stream between replays: the step's host-to-device copies, the attention
plan's copies into the graph's static buffers, the logits' row pick and fp32 cast, the sampler, the token's copy
to the host. This runs one request of --prompt tokens through an engine with random weights of the real shapes
(engine/model_factory.random_for_engine, warmed up as a Serve replica is), decodes --warm tokens, then traces
--steps engine steps with torch.profiler and reads every device event (kernels, copies, memsets) from the trace:
events launched by cudaGraphLaunch are the graph's, the rest are "outside". Per step (one graph replay to the
next): the period, the graph's span, and each outside event's name and duration; the median step is printed and
written with all steps. Before the trace --timed steps are timed without the profiler (its host overhead can make
the host, not the GPU, the bound while tracing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(trace: dict) -> list[dict]:
    """Device events (kernels, copies, memsets) in start order, each with `graph`: launched by cudaGraphLaunch."""
    events = trace.get("traceEvents", [])
    graph_corr = {e["args"]["correlation"] for e in events
                  if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
                  and "GraphLaunch" in e.get("name", "") and "correlation" in e.get("args", {})}
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS:
            corr = e.get("args", {}).get("correlation")
            out.append({"name": e["name"], "start": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"]),
                        "dur": float(e["dur"]), "cat": e["cat"], "graph": corr in graph_corr})
    return sorted(out, key=lambda e: e["start"])


def split_steps(events: list[dict]) -> list[dict]:
    """One record per graph replay followed by another: the period between their first kernels, the graph's span,
    and the outside events between the replay's last kernel and the next one's first (the step's non-graph work)."""
    replays, cur = [], None
    for e in events:  # a replay is a run of graph events; an outside event ends it
        if e["graph"]:
            if cur is None:
                cur = {"start": e["start"], "end": e["end"], "kernels": 0}
                replays.append(cur)
            cur["end"] = max(cur["end"], e["end"])
            cur["kernels"] += 1
        else:
            cur = None
    steps = []
    for a, b in zip(replays, replays[1:]):
        outside = [e for e in events if not e["graph"] and a["end"] <= e["start"] < b["start"]]
        steps.append({"period_us": b["start"] - a["start"], "graph_us": a["end"] - a["start"],
                      "between_us": b["start"] - a["end"], "graph_kernels": a["kernels"],
                      "outside": [{"name": e["name"][:90], "cat": e["cat"], "dur_us": round(e["dur"], 2)}
                                  for e in outside],
                      "outside_busy_us": round(sum(e["dur"] for e in outside), 2)})
    return steps


def summarize(steps: list[dict]) -> dict:
    """The median step by period, and per outside-event name: calls per step and mean duration over all steps."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for s in steps:
        for e in s["outside"]:
            by_name[e["name"]].append(e["dur_us"])
    n = max(1, len(steps))
    names = sorted(({"name": k, "per_step": round(len(v) / n, 2), "mean_us": round(statistics.mean(v), 2)}
                    for k, v in by_name.items()), key=lambda r: -r["per_step"] * r["mean_us"])
    med = sorted(steps, key=lambda s: s["period_us"])[len(steps) // 2] if steps else {}
    return {"steps": len(steps), "median_period_us": med.get("period_us"), "median_graph_us": med.get("graph_us"),
            "median_between_us": med.get("between_us"), "median_step": med, "outside_by_name": names,
            "mean_outside_events": round(sum(len(s["outside"]) for s in steps) / n, 2)}


def decode_tokens(engine, n: int) -> float:
    """Step the engine until n more tokens came out; seconds per token."""
    got, t0 = 0, time.perf_counter()
    while got < n and engine.has_unfinished():
        got += sum(len(d.token_ids) for d in engine.step())
    return (time.perf_counter() - t0) / max(1, got)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--warm", type=int, default=32, help="tokens decoded before anything is timed")
    p.add_argument("--steps", type=int, default=40, help="engine steps traced")
    p.add_argument("--timed", type=int, default=256, help="engine steps timed without the profiler first (long enough "
                                                          "for the page tables to cross a 16-page width)")
    p.add_argument("--kv-gb", type=float, default=2.0, help="the engine's K/V pool (one short request needs little)")
    p.add_argument("--dense-dtype", default="auto")
    p.add_argument("--lm-head-dtype", default="auto")
    p.add_argument("--mxfp4-decode-max-tokens", type=int, default=0)
    p.add_argument("--out", default="bench/results/engine_step_profile.json")
    args = p.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_factory import random_for_engine
    from engine.request import GenerateRequest, SamplingParams
    from engine.warm_up import warm_up
    from model.config import GptOssConfig

    total = args.prompt + args.warm + args.timed + 2 * args.steps + 8
    mc = GptOssConfig.preset(args.model)
    config = EngineConfig(device="cuda", max_num_seqs=4, max_num_batched_tokens=max(2048, args.prompt),
                          max_model_len=total + 64, cuda_graphs=True, lm_head_dtype=args.lm_head_dtype,
                          dense_dtype=args.dense_dtype, mxfp4_decode_max_tokens=args.mxfp4_decode_max_tokens,
                          kv_cache_bytes=int(args.kv_gb * 2**30))
    t0 = time.perf_counter()
    model = random_for_engine(mc, config)
    engine = LLMEngine(model, config)
    build_s = time.perf_counter() - t0
    warm_up(engine)
    prompt = torch.randint(0, mc.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.add_request(GenerateRequest("profiled", prompt, SamplingParams(temperature=0.0, max_tokens=total - args.prompt,
                                                                          ignore_eos=True)))
    decode_tokens(engine, args.warm)
    plain_s = decode_tokens(engine, args.timed)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        traced_s = decode_tokens(engine, args.steps)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = device_events(json.loads(Path(f.name).read_text()))
    steps = split_steps(events)
    summary = summarize(steps)
    while engine.has_unfinished():
        engine.step()
    print(f"{args.model}: engine {1e3 * plain_s:.3f} ms per token untraced, {1e3 * traced_s:.3f} traced; "
          f"median traced step {summary['median_period_us']:.1f} us = graph {summary['median_graph_us']:.1f} + "
          f"between replays {summary['median_between_us']:.1f} ({summary['mean_outside_events']} device events "
          f"outside the graph per step)")
    print(f"{'outside the graph':70s} {'per step':>8s} {'mean us':>8s}")
    for r in summary["outside_by_name"][:25]:
        print(f"{r['name'][:70]:70s} {r['per_step']:8.2f} {r['mean_us']:8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "device": torch.cuda.get_device_name(), "args": vars(args), "build_s": build_s,
                               "ms_per_token_untraced": 1e3 * plain_s, "ms_per_token_traced": 1e3 * traced_s,
                               **summary, "all_steps": steps}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
