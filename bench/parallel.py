"""One model instance over several GPUs (issue 10): TP/EP splits through LLMEngine, random weights of the
real shapes (no checkpoint download here), measured end to end on the host.

    python -m bench.parallel --model gpt-oss-120b --splits 4x4,4x1,1x4 --device cuda \\
        --out bench/results/parallel_h200x4.json                        (a 4-GPU host)
    python -m bench.parallel --tiny --device cpu --splits 1x1,2x2       (CPU smoke run over gloo)

Per split TPxEP (max(TP, EP) ranks, one process and one device each; engine/distributed): engine build
seconds, then
- b1: one request alone, --b1-in prompt tokens and --b1-out output tokens: TTFT and ms per output token
  (host work included; the target for 120b on 4 GPUs is >= 800 tok/s for the replica);
- prefill: one --prefill-len prompt, max_tokens=1: time to its token;
- throughput: --batch requests of --tp-in / --tp-out tokens at once: output tok/s for the replica and
  per GPU.
Random weights: every rank draws its shard from the same seed, so shards are not slices of one model;
the timings do not depend on it. Decode steps replay CUDA graphs on every rank (--graphs off: eager,
for comparison); --parts profile adds rank 0's torch.profiler view of batch-1 decode steps. Correctness
over ranks is tests/engine/test_parallel_engine.py and tests/engine/test_parallel_graphs_gpu.py.
Not covered here: DP (two replicas of TP2/EP2: two processes of this command on disjoint devices) and
prefill on some GPUs with decode on others (bench/disaggregated.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from bench.e2e import tiny_config
from bench.e2e_engine_runs import timed_single
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerateRequest, SamplingParams
from model.config import GptOssConfig


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def throughput(engine: LLMEngine, batch: int, in_len: int, out_len: int, vocab: int, world: int) -> dict:
    reqs = [GenerateRequest(f"t{i}", prompt(in_len, vocab, 100 + i), SamplingParams(
        temperature=0.0, max_tokens=out_len, ignore_eos=True)) for i in range(batch)]
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.output_ids) for o in outs)
    return {"requests": batch, "in_len": in_len, "out_len": out_len, "wall_s": wall, "output_tok_s": tokens / wall,
            "output_tok_s_per_gpu": tokens / wall / world}


def profile_decode(engine: LLMEngine, vocab: int, prompt_len: int, steps: int = 8, n: int = 8) -> dict:
    """Rank 0's view of `steps` batch-1 decode steps (torch.profiler, CPU + CUDA): the top CPU ops by self
    time and the top kernels, to say where a step's wall time goes (host launches, waits, collectives)."""
    from torch.profiler import ProfilerActivity, profile

    engine.add_request(GenerateRequest("profiled", prompt(prompt_len, vocab, 5), SamplingParams(
        temperature=0.0, max_tokens=steps + 4, ignore_eos=True)))
    for _ in range(3):  # prefill and the first decode steps outside the window
        engine.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    events = prof.key_averages()
    cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    gpu = sorted((e for e in events if getattr(e, "self_device_time_total", 0) > 0),
                 key=lambda e: e.self_device_time_total, reverse=True)[:n]
    return {"steps": steps, "step_ms": 1e3 * wall / steps,
            "cpu_ops": [{"name": e.key, "calls": e.count, "self_cpu_us_per_step": e.self_cpu_time_total / steps}
                        for e in cpu],
            "kernels": [{"name": e.key[:80], "calls": e.count, "us_per_step": e.self_device_time_total / steps}
                        for e in gpu]}


def run_split(shapes: GptOssConfig, tp: int, ep: int, args, save=lambda rec: None) -> dict:
    """One split's record; `save(rec)` after each part, so a run cut short keeps what it measured."""
    world = max(tp, ep)
    longest = max(args.prefill_len + 1, args.b1_in + args.b1_out, args.tp_in + args.tp_out)
    graphs = args.device.startswith("cuda") and args.graphs == "on"
    config = EngineConfig(device=args.device, dtype=args.dtype, tp_size=tp, ep_size=ep, max_num_seqs=args.batch,
                          max_num_batched_tokens=max(args.chunk, args.batch), max_model_len=longest,
                          kv_cache_dtype=args.kv_cache_dtype, lm_head_dtype=args.lm_head_dtype,
                          all_reduce=args.all_reduce,
                          cuda_graphs=graphs, async_decode={"on": True, "off": False}.get(args.lookahead),
                          prefill_graphs={"on": True, "off": False}.get(args.prefill_graphs),
                          kv_cache_bytes=args.kv_cache_mb * 2**20 if args.kv_cache_mb else None)
    t0 = time.perf_counter()
    engine = LLMEngine.with_random_weights(shapes, config, seed=args.seed)
    fast = engine.runner.model.parallel.fast_all_reduce  # rank 0's symmetric-memory sums, when set up
    rec = {"split": f"tp{tp} ep{ep}", "tp": tp, "ep": ep, "gpus": world, "all_reduce": config.all_reduce,
           "all_reduce_used": "symm_mem" if fast is not None else "nccl", "build_s": time.perf_counter() - t0,
           "cuda_graphs": config.cuda_graphs, "graph_capture_s": sum(engine.graph_capture_seconds.values()),
           "prefill_graphs": config.uses_prefill_graphs,
           "prefill_graph_capture_s": sum(engine.prefill_graph_capture_seconds.values()),
           "async_decode": engine.async_decode, "full_pages": engine.block_manager.usage()["full_pages_total"]}
    try:
        def done(part: str) -> None:  # progress, for runs cut short by a time limit
            print(f"  [{rec['split']}] {part} done at {time.perf_counter() - t0:.1f} s", flush=True)
            save(rec)

        done(f"build (capture {rec['graph_capture_s']:.1f} s)")
        timed_single(engine, prompt(16, shapes.vocab_size, 1), 4)  # warm-up: first launches, JIT, graphs
        done("warm-up")
        if "b1" in args.parts:
            rec["b1"] = timed_single(engine, prompt(args.b1_in, shapes.vocab_size, 2), args.b1_out)
            done(f"b1 ({rec['b1'].get('tok_s_user', 0):.0f} tok/s)")
        if "profile" in args.parts:
            rec["b1_profile"] = profile_decode(engine, shapes.vocab_size, args.b1_in)
            done("profile")
        if "prefill" in args.parts:
            rec["prefill"] = timed_single(engine, prompt(args.prefill_len, shapes.vocab_size, 3), 1)
            done("prefill")
        if "throughput" in args.parts:
            rec["throughput"] = throughput(engine, args.batch, args.tp_in, args.tp_out, shapes.vocab_size, world)
        rec["graph_replays"] = engine.runner.decode_graphs.replays if engine.runner.decode_graphs is not None else 0
        done("throughput" if "throughput" in args.parts else "all parts")
    finally:
        engine.close()
        del engine
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"[{rec['split']} graphs {'on' if rec['cuda_graphs'] else 'off'}] build {rec['build_s']:.1f} s"
          f" (capture {rec['graph_capture_s']:.1f} s) | {summary(rec, args)}", flush=True)
    if "b1_profile" in rec:
        prof = rec["b1_profile"]
        print(f"  b1 profiled step {prof['step_ms']:.2f} ms; top CPU ops (self us/step): " + ", ".join(
            f"{o['name']} {o['self_cpu_us_per_step']:.0f}" for o in prof["cpu_ops"][:5]), flush=True)
    return rec


def summary(rec: dict, args) -> str:
    parts = []
    if "b1" in rec:
        parts.append(f"b1 TTFT {rec['b1']['ttft_ms']:.1f} ms, {rec['b1'].get('tok_s_user', 0):.0f} tok/s")
    if "prefill" in rec:
        parts.append(f"prefill {args.prefill_len}: {rec['prefill']['ttft_ms']:.1f} ms")
    if "throughput" in rec:
        t = rec["throughput"]
        parts.append(f"{t['requests']} x {t['in_len']}/{t['out_len']}: {t['output_tok_s']:.0f} tok/s "
                     f"({t['output_tok_s_per_gpu']:.0f} per GPU)")
    return " | ".join(parts)


def parse_splits(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        tp, _, ep = part.partition("x")
        if not (tp.isdigit() and ep.isdigit()):
            raise argparse.ArgumentTypeError(f"splits are TPxEP, e.g. 4x4,2x2; got {part!r}")
        out.append((int(tp), int(ep)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-oss-120b", help="a preset (real shapes, random weights)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and lengths (CPU smoke run)")
    p.add_argument("--splits", type=parse_splits, default=parse_splits("4x4,4x1,1x4"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "fp8_e4m3"))
    p.add_argument("--lm-head-dtype", default="auto", choices=("auto", "fp8_e4m3"))
    p.add_argument("--all-reduce", default="auto", choices=("auto", "nccl", "symm_mem"), help="the ranks' sums (CUDA)")
    p.add_argument("--kv-cache-mb", type=int, help="K/V budget per rank (default: the engine's)")
    p.add_argument("--lookahead", choices=("auto", "on", "off"), default="auto",
                   help="the decode lookahead (auto: the engine's default, on for CUDA)")
    p.add_argument("--graphs", choices=("on", "off"), default="on", help="decode CUDA graphs (CUDA only)")
    p.add_argument("--prefill-graphs", choices=("auto", "on", "off"), default="auto",
                   help="piecewise prefill graphs (engine/prefill_graphs.py); auto: with --graphs on")
    p.add_argument("--parts", type=lambda t: set(t.split(",")), default={"b1", "prefill", "throughput"},
                   help="comma list of b1, profile (rank 0's profile of batch-1 decode steps), prefill, throughput")
    p.add_argument("--b1-in", type=int, default=1024)
    p.add_argument("--b1-out", type=int, default=256)
    p.add_argument("--prefill-len", type=int, default=8192)
    p.add_argument("--tp-in", type=int, default=1024)
    p.add_argument("--tp-out", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256, help="requests of the throughput run (and max_num_seqs)")
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/parallel.json")
    args = p.parse_args(argv)
    if args.tiny:
        shapes = tiny_config()
        args.b1_in, args.b1_out, args.prefill_len, args.tp_in, args.tp_out = 24, 8, 48, 16, 8
        args.batch, args.chunk = min(args.batch, 4), min(args.chunk, 64)
    else:
        shapes = GptOssConfig.preset(args.model)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    results = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": "tiny" if args.tiny else args.model,
               "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "gpus_visible": torch.cuda.device_count(), "torch": torch.__version__,
               "args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items() if k != "splits"},
               "splits": [f"{tp}x{ep}" for tp, ep in args.splits], "runs": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    def save(rec: dict) -> None:
        out.write_text(json.dumps({**results, "runs": results["runs"] + [rec]}, indent=1))

    for tp, ep in args.splits:
        results["runs"].append(run_split(shapes, tp, ep, args, save))
        out.write_text(json.dumps(results, indent=1))
    print(f"\n{'split':10s} {'graphs':>6s} {'GPUs':>4s} {'b1 tok/s':>9s} {'b1 TTFT ms':>10s} {'prefill ms':>10s} "
          f"{'tput tok/s':>10s} {'per GPU':>8s}")
    for r in results["runs"]:
        b1, pre, tput = r.get("b1", {}), r.get("prefill", {}), r.get("throughput", {})
        print(f"{r['split']:10s} {'on' if r['cuda_graphs'] else 'off':>6s} {r['gpus']:4d} {b1.get('tok_s_user', 0):9.0f} "
              f"{b1.get('ttft_ms', 0):10.1f} {pre.get('ttft_ms', 0):10.1f} {tput.get('output_tok_s', 0):10.0f} "
              f"{tput.get('output_tok_s_per_gpu', 0):8.0f}")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
