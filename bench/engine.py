"""Engine benchmark: offline throughput on the tiny model, host overhead per step, KV saved by freeing
sliding-window pages. A command, not a test: it measures and reports, it asserts nothing.

    python -m bench.engine                   # CPU, fp32 tiny model
    python -m bench.engine --device cuda     # on a GPU host (bf16)

Prints a table and writes bench/results/engine-<UTC time>-<device>.json.

Host overhead = schedule + prepare (step metadata, H2D copies) + update (sequences, page freeing,
deltas); it is what remains of a step when the forward is free, and the figure to hold under 5%
of a GPU decode step at batch 64. `forward` also holds the sampler and the step's one device read.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from engine.block_manager import BlockManager
from engine.page_pool import cdiv
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerateRequest, SamplingParams
from engine.step_arrays import StepArrayBuilder, build_step_arrays
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from kernels.attention import PagedKVCache
from model.config import GptOssConfig
from model.loader import load_model
from model.tiny import TINY_DEFAULTS, make_tiny

RESULTS = Path(__file__).resolve().parent / "results"


def _us(seconds: list[float], q: float | None = None) -> float:
    if not seconds:
        return float("nan")
    if q is None:
        return 1e6 * statistics.median(seconds)
    return 1e6 * sorted(seconds)[min(len(seconds) - 1, int(q * len(seconds)))]


def throughput(model, device: str, mode: str, num_requests: int, max_tokens: int, seed: int) -> dict:
    """All requests at once, as one continuous batch; every request runs to max_tokens."""
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=1024, device=device,
                          kv_cache_bytes=256 * 2**20)
    engine = LLMEngine(model, config)
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    sampling = (SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) if mode == "greedy" else
                SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=max_tokens, ignore_eos=True))
    warm = GenerateRequest("warmup", [1, 2, 3], SamplingParams(temperature=sampling.temperature, max_tokens=4))
    engine.generate([warm])  # first-call allocations and kernel selection stay out of the timing
    lengths = torch.randint(16, 257, (num_requests,), generator=g).tolist()
    for i, n in enumerate(lengths):
        engine.add_request(GenerateRequest(f"r{i}", torch.randint(0, vocab, (n,), generator=g).tolist(), sampling))
    steps, decode64 = [], []
    start = time.perf_counter()
    while engine.has_unfinished():
        before = engine.metrics.prefill_tokens_total
        batch = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        engine.step()
        t = engine.metrics.last_step
        steps.append(t)
        if engine.metrics.prefill_tokens_total == before and batch == num_requests:
            decode64.append(t)
    wall = time.perf_counter() - start
    snap = engine.metrics.snapshot()
    out_tokens = num_requests * max_tokens
    return {
        "mode": mode, "requests": num_requests, "prompt_tokens": sum(lengths), "output_tokens": out_tokens,
        "wall_s": wall, "steps": len(steps), "output_tok_per_s": out_tokens / wall,
        "total_tok_per_s": (out_tokens + sum(lengths)) / wall,
        "ttft_mean_ms": 1e3 * snap["ttft_seconds"]["mean"], "tpot_mean_ms": 1e3 * snap["tpot_seconds"]["mean"],
        "step_us_median": {k: _us([getattr(s, k) for s in steps]) for k in ("schedule", "prepare", "forward", "update")},
        "decode_steps_at_batch": num_requests,
        "decode_step_us_median": _us([s.forward + s.host_overhead for s in decode64]),
        "decode_host_overhead_us_median": _us([s.host_overhead for s in decode64]),
        "decode_host_overhead_us_p90": _us([s.host_overhead for s in decode64], 0.9),
        "decode_host_overhead_share": (statistics.median(s.host_overhead for s in decode64)
                                       / statistics.median(s.forward + s.host_overhead for s in decode64)),
    }


def scheduler_overhead(device: str, batch: int, context: int, steps: int = 200) -> dict:
    """The host side of decode steps at long context, without a model: schedule, metadata, page freeing."""
    config = EngineConfig(block_size=16, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch),
                          max_model_len=context + steps + 1)
    bm = BlockManager(16, 128, batch * cdiv(context + steps + 1, 16), batch * 10 + 2048 // 16)
    sched = Scheduler(config, bm)
    for i in range(batch):
        seq = Sequence(f"s{i}", [1] * context, SamplingParams(max_tokens=steps + 1), seed=i, arrival=i)
        sched.add(seq)
        while seq.num_computed < context:  # as if prefilled in 2048-token chunks
            seq.num_computed = min(context, seq.num_computed + 2048)
            bm.allocate(seq, seq.num_computed)
            bm.release_out_of_window(seq)
        seq.output_ids.append(0)
    sched.waiting, sched.running = [], list(sched.waiting)
    times = {"schedule": [], "prepare": [], "update": []}
    scratch = []  # build_step_arrays alone, what prepare cost before the decode fast path
    builder = StepArrayBuilder(16)
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        builder.build(out.scheduled).to_inputs(device)
        if device != "cpu":
            torch.cuda.synchronize()  # count the copies as done
        t2 = time.perf_counter()
        build_step_arrays(out.scheduled, 16)
        scratch.append(time.perf_counter() - t2)
        t2b = time.perf_counter()
        for s in out.scheduled:
            s.seq.num_computed = s.end
            bm.release_out_of_window(s.seq)
            s.seq.output_ids.append(0)
        t3 = time.perf_counter()
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2b)):
            times[k].append(v)
    per_step = [a + b + c for a, b, c in zip(*times.values())]
    return {"batch": batch, "context": context, **{f"{k}_us_median": _us(v) for k, v in times.items()},
            "host_us_median": _us(per_step), "host_us_p90": _us(per_step, 0.9),
            "build_step_arrays_from_scratch_us_median": _us(scratch)}


def small_config(max_positions: int) -> GptOssConfig:
    """A 2-layer gpt-oss of tiny widths: the host side of a step with next to no model."""
    return GptOssConfig(num_hidden_layers=2, num_local_experts=4, vocab_size=1024, hidden_size=64, intermediate_size=64,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=max(2 * max_positions, 4096))


def paced_engine(batch: int, context: int, gpu_ms: float, max_tokens: int) -> LLMEngine:
    """An engine of a 2-layer model whose forward is a busy wait of gpu_ms (a GPU step: CUDA's default
    synchronization spins, so the host core stays busy), with `batch` requests of `context` prompt tokens
    prefilled and decoding: the host side as a GPU host would run it."""
    cfg = small_config(context + 1024)
    from model.gpt_oss import GptOssForCausalLM

    engine = LLMEngine(GptOssForCausalLM(cfg), EngineConfig(
        max_num_seqs=batch, max_num_batched_tokens=8192, max_model_len=context + 1024, device="cpu",
        kv_cache_bytes=batch * (context + 1024) * 2 * 2 * 16 * 4 * 2))
    logits = torch.zeros(batch, cfg.vocab_size)

    def gpu_step(inputs):
        end = time.perf_counter() + gpu_ms / 1e3
        while time.perf_counter() < end:
            pass
        return logits[: len(inputs.sample_rows)]

    engine.runner.execute = gpu_step
    return filled(engine, batch, context, max_tokens)


def filled(engine: LLMEngine, batch: int, context: int, max_tokens: int) -> LLMEngine:
    """`engine` with `batch` requests of `context` prompt tokens prefilled and decoding."""
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(GenerateRequest(f"r{i}", [(i + j) % 1000 + 1 for j in range(context)], sampling))
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()
    return engine


def real_engine(model: str, batch: int, context: int, device: str) -> LLMEngine:
    """An engine over random weights of a preset's shapes (gpt-oss-20b, gpt-oss-120b; "small": small_config's) with
    the engine's defaults on `device` (graphs, lookahead, FlashInfer and the FP8 MoE on a GPU), filled as
    paced_engine's."""
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=8192, max_model_len=context + 1024,
                          device=device)
    shapes = small_config(context + 1024) if model == "small" else GptOssConfig.preset(model)
    return filled(LLMEngine.with_random_weights(shapes, config), batch, context, 10_000)


def host_work(batch: int, context: int, gpu_ms: float = 5.0, steps: int = 100) -> dict:
    """Median schedule, prepare and update (us) of the engine's decode steps as it is, forward paced (paced_engine):
    the host work a decode replica's process does per step beside its asyncio loop."""
    engine = paced_engine(batch, context, gpu_ms, steps + 20)
    times = []
    for i in range(steps + 10):
        engine.step()
        if i >= 10:
            last = engine.metrics.last_step
            times.append((last.schedule, last.prepare, last.update))
    parts = dict(zip(("schedule", "prepare", "update"), (_us(list(t)) for t in zip(*times))))
    return {"batch": batch, "context": context, "gpu_ms": gpu_ms, **{f"{k}_us_median": v for k, v in parts.items()},
            "host_us_median": _us([sum(t) for t in times])}


def decode_fast_paths(batch: int = 64, context: int = 8192, gpu_ms: float = 5.0, rounds: int = 6) -> dict:
    """The engine's decode fast paths (scheduler shortcut, incremental step metadata, the common row's shortcut in
    reading a step) against the general paths, alternating in one engine and one process (paced_engine)."""
    from engine.step_arrays import build_step_inputs

    engine = paced_engine(batch, context, gpu_ms, 1 + rounds * 3 * 2 * 15)
    runner, sched = engine.runner, engine.scheduler
    fast_prepare, fast_schedule = runner.prepare, sched._all_decode
    variants = {
        "prepare": {"fast": fast_prepare, "general": lambda scheduled: build_step_inputs(scheduled, 16, runner.device)},
        "schedule": {"fast": fast_schedule, "general": lambda kind: False},
        "update": {"fast": True, "general": False},  # LLMEngine.fast_rows: _resolve's shortcut for the common row
    }
    out = {"batch": batch, "context": context, "gpu_ms": gpu_ms}
    for part, fns in variants.items():
        times = {"fast": [], "general": []}
        for _ in range(rounds):
            for name, fn in fns.items():
                if part == "prepare":
                    runner.prepare = fn
                    runner.step_arrays._arrays = None
                elif part == "update":
                    engine.fast_rows = fn
                else:
                    sched._all_decode = fn
                for i in range(15):
                    engine.step()
                    if i >= 2:  # the first steps after a switch rebuild their caches
                        times[name].append(getattr(engine.metrics.last_step, part))
        runner.prepare, sched._all_decode, engine.fast_rows = fast_prepare, fast_schedule, True
        out[part] = {name: _us(v) for name, v in times.items()}
    return out


# steady_traffic's variants, alternating in one engine: (the step metadata's carry path, the scheduler's decode runs)
STEADY_VARIANTS = {"fast": (True, True), "scratch": (False, True), "loop": (True, False)}


def steady_traffic(batch: int = 512, context: int = 2048, gpu_ms: float = 5.0, rounds: int = 6, block: int = 16,
                   engine: LLMEngine | None = None) -> dict:
    """Host work per step under steady traffic in one engine (paced_engine), three variants alternating every
    `block` steps: as it is ("fast"), the step metadata rebuilt from scratch instead of carried (StepArrayBuilder's
    carry off: "scratch"), and the scheduler's loop without its decode runs ("loop"). `batch` seats, 7/8 of them
    decoding at the start; a request of `context` prompt tokens arrives every second step and asks for 16..256
    tokens, so nearly every step has a sequence joining or leaving, and every second one a prefill chunk (with
    prompts longer than the step's token budget, chunks of one prompt span steps). Medians (us) by step kind and
    variant, each variant's output tokens per second of wall time, and the bytes a multi-rank rank 0 would send per
    carried step. `engine`: a filled real one (real_engine) instead of paced_engine's."""
    import random

    from engine.distributed.wire import pack_step, pack_step_carry

    engine = engine or paced_engine(batch, context, gpu_ms, 10_000)
    for i in range(batch // 8):
        engine.abort(f"r{i}")
    rng, builder, sched, arrived = random.Random(0), engine.runner.step_arrays, engine.scheduler, 0
    times: dict[tuple[str, str], list] = {(v, k): [] for v in STEADY_VARIANTS for k in ("decode", "mixed")}
    wire: dict[str, list] = {"step": [], "carry": []}
    wall, made = dict.fromkeys(STEADY_VARIANTS, 0.0), dict.fromkeys(STEADY_VARIANTS, 0)  # seconds, decode tokens
    for _ in range(rounds):
        for variant, (carry, runs) in STEADY_VARIANTS.items():
            builder.carry, sched.decode_runs = carry, runs
            for i in range(block):
                if i % 2 == 0:
                    engine.add_request(GenerateRequest(f"new{arrived}", [rng.randrange(1, 1000) for _ in range(context)],
                                                       SamplingParams(temperature=0, max_tokens=rng.randint(16, 256),
                                                                      ignore_eos=True)))
                    arrived += 1
                prefilled, decoded = engine.metrics.prefill_tokens_total, engine.metrics.decode_tokens_total
                t0 = time.perf_counter()
                engine.step()
                took = time.perf_counter() - t0
                last = engine.metrics.last_step
                if i >= 2:  # the first steps after a switch
                    kind = "mixed" if engine.metrics.prefill_tokens_total > prefilled else "decode"
                    times[(variant, kind)].append((last.schedule, last.prepare, last.update))
                    wall[variant] += took
                    made[variant] += engine.metrics.decode_tokens_total - decoded
                if builder.last_carry is not None:
                    wire["step"].append(len(pack_step(builder._arrays)))
                    wire["carry"].append(len(pack_step_carry(builder._arrays, *builder.last_carry[1:], 0)))
    builder.carry, sched.decode_runs = True, True
    out = {"batch": batch, "context": context, "gpu_ms": gpu_ms, "running_at_end": len(engine.scheduler.running),
           "wire_bytes_median": {k: statistics.median(v) if v else None for k, v in wire.items()},
           "decode_tok_s": {v: made[v] / wall[v] if wall[v] else None for v in STEADY_VARIANTS}}
    for (variant, kind), rows in times.items():  # (a kind no step had: its count only)
        out[f"{kind}_{variant}"] = {"steps": len(rows)} if not rows else {
            "steps": len(rows), **dict(zip(("schedule", "prepare", "update"), (_us(list(t)) for t in zip(*rows)))),
            "host": _us([sum(t) for t in rows])}
    return out


def kv_saving(preset: str, length: int = 32768, block: int = 16) -> dict:
    """Pages and bytes of one `length`-token sequence: window freeing vs every layer keeping every page."""
    c = GptOssConfig.preset(preset)
    n_sliding = sum(c.is_sliding(i) for i in range(c.num_hidden_layers))
    n_full = c.num_hidden_layers - n_sliding
    bm = BlockManager(block, c.sliding_window, cdiv(length, block), 64)
    seq = Sequence("long", [0], SamplingParams(), 0, 0)
    peak_sliding = 0
    for pos in range(length):  # decode token by token to the full length
        bm.allocate(seq, pos + 1)
        peak_sliding = max(peak_sliding, len(seq.sliding_pages))
        seq.num_computed = pos + 1
        bm.release_out_of_window(seq)
    page = {kind: PagedKVCache.bytes_per_block(n, c.num_key_value_heads, c.head_dim, block, torch.bfloat16)
            for kind, n in (("full", n_full), ("sliding", n_sliding))}
    pages = cdiv(length, block)
    naive = pages * (page["full"] + page["sliding"])
    windowed = pages * page["full"] + peak_sliding * page["sliding"]
    return {"preset": preset, "tokens": length, "block_size": block, "full_pages": bm.full.num_used,
            "sliding_pages_peak": peak_sliding, "naive_pages": 2 * pages, "naive_gib": naive / 2**30,
            "windowed_gib": windowed / 2**30, "saving": 1 - windowed / naive}


def _table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--host-only", action="store_true",
                        help="only the host work per decode step at batch 64, 256 and 512 (host_work) and under "
                             "steady traffic at 64 and 512 (steady_traffic; 2k and 8k prompts), on the CPU")
    parser.add_argument("--steady", metavar="MODEL",
                        help="only steady_traffic with a real engine over random weights of MODEL (gpt-oss-20b, "
                             "gpt-oss-120b; small: a 2-layer model) on --device, at --batch sequences and "
                             "--context-tokens prompts")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--context-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.host_only:
        return _host_only(args.out)
    if args.steady:
        return _steady_real(args)

    with tempfile.TemporaryDirectory() as folder:
        make_tiny(folder, dtype=dtype)
        model = load_model(folder, dtype=dtype, device=args.device, progress=False)
        runs = [throughput(model, args.device, mode, args.requests, args.max_tokens, args.seed)
                for mode in ("greedy", "sampled")]
    overhead = [scheduler_overhead(args.device, 64, ctx) for ctx in (1024, 32768)]
    fast_paths = [decode_fast_paths(b) for b in (16, 64, 256)] + [decode_fast_paths(512, context=2048)]
    host = [host_work(b, 2048) for b in (64, 512)]
    savings = [kv_saving(p) for p in ("gpt-oss-120b", "gpt-oss-20b")]

    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    for r in runs:
        _table(f"throughput, tiny model ({TINY_DEFAULTS['num_hidden_layers']} layers, vocab "
               f"{TINY_DEFAULTS['vocab_size']}), {args.device} {dtype}, {r['mode']}", [
            ("requests x tokens", f"{r['requests']} x {args.max_tokens} (prompts 16..256, {r['prompt_tokens']} tokens)"),
            ("wall", f"{r['wall_s']:.2f} s in {r['steps']} steps"),
            ("output tokens/s", f"{r['output_tok_per_s']:.0f}  (prompt + output: {r['total_tok_per_s']:.0f}/s)"),
            ("TTFT / TPOT mean", f"{r['ttft_mean_ms']:.1f} ms / {r['tpot_mean_ms']:.2f} ms"),
            ("step median us", "  ".join(f"{k} {v:.0f}" for k, v in r["step_us_median"].items())),
            (f"decode @{r['decode_steps_at_batch']}: step / host",
             f"{r['decode_step_us_median']:.0f} us / {r['decode_host_overhead_us_median']:.0f}"
                                        f" us (p90 {r['decode_host_overhead_us_p90']:.0f}),"
                                        f" {100 * r['decode_host_overhead_share']:.1f}% of the step"),
        ])
    _table("scheduler + metadata + page freeing per decode step, no model (batch 64)", [
        (f"context {o['context']}", f"{o['host_us_median']:.0f} us (p90 {o['host_us_p90']:.0f}): schedule "
                                    f"{o['schedule_us_median']:.0f}, prepare {o['prepare_us_median']:.0f}, "
                                    f"update {o['update_us_median']:.0f}") for o in overhead])
    _table("decode fast paths vs general paths, one engine, forward = 5 ms busy wait (median us)", [
        (f"batch {f['batch']}, context {f['context'] // 1024}k",
         f"schedule {f['schedule']['general']:.0f} -> {f['schedule']['fast']:.0f}, step metadata "
         f"{f['prepare']['general']:.0f} -> {f['prepare']['fast']:.0f}, update {f['update']['general']:.0f} -> "
         f"{f['update']['fast']:.0f}") for f in fast_paths])
    _host_table(host)
    _table("KV of one 32k-token sequence, pages of 16, bf16", [
        (s["preset"], f"{s['full_pages']} full + {s['sliding_pages_peak']} sliding pages = {s['windowed_gib']:.3f} GiB"
                      f" vs naive {s['naive_pages']} pages = {s['naive_gib']:.3f} GiB: {100 * s['saving']:.1f}% saved")
        for s in savings])

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"engine-{stamp}-{args.device.replace(':', '')}.json"
    path.write_text(json.dumps({"date": stamp, "device": args.device, "device_name": device_name, "dtype": dtype,
                                "torch": torch.__version__, "threads": torch.get_num_threads(),
                                "throughput": runs, "scheduler_overhead": overhead,
                                "decode_fast_paths": fast_paths, "host_work": host, "kv_saving": savings},
                               indent=2))
    print(f"\nwrote {path}")
    return 0


def _host_table(rows: list[dict]) -> None:
    _table("the engine's host work per decode step, forward = 5 ms busy wait (median us)", [
        (f"batch {h['batch']}, context {h['context'] // 1024}k",
         f"{h['host_us_median']:.0f}: schedule {h['schedule_us_median']:.0f}, prepare {h['prepare_us_median']:.0f}, "
         f"update {h['update_us_median']:.0f}") for h in rows])


def _steady_table(rows: list[dict]) -> None:
    def pair(r: dict, kind: str, other: str, part: str) -> str:
        a, b = r[f"{kind}_{other}"], r[f"{kind}_fast"]
        return f"{a[part]:.0f} -> {b[part]:.0f}"

    lines = []
    for r in rows:
        for kind in ("decode", "mixed"):
            if all(r[f"{kind}_{v}"]["steps"] for v in STEADY_VARIANTS):
                lines.append((f"batch {r['batch']}, {r['context']:,}-token prompts, {kind} steps "
                              f"({'+'.join(str(r[f'{kind}_{v}']['steps']) for v in STEADY_VARIANTS)})",
                              f"host {pair(r, kind, 'scratch', 'host')}, prepare {pair(r, kind, 'scratch', 'prepare')}"
                              f" (carried); host {pair(r, kind, 'loop', 'host')}, schedule "
                              f"{pair(r, kind, 'loop', 'schedule')} (decode runs)"))
        tok_s = r.get("decode_tok_s", {})
        if all(tok_s.get(v) for v in STEADY_VARIANTS):
            lines.append((f"batch {r['batch']}, {r['context']:,}-token prompts, decode tokens/s (wall)",
                          "  ".join(f"{v} {tok_s[v]:,.0f}" for v in STEADY_VARIANTS)))
        if r["wire_bytes_median"]["carry"]:
            lines.append((f"batch {r['batch']}, {r['context']:,}-token prompts, bytes to the other ranks per carried "
                          "step", f"{r['wire_bytes_median']['step']:,.0f} (STEP) -> "
                                  f"{r['wire_bytes_median']['carry']:,.0f} (STEP_CARRY)"))
    _table("steady traffic: host work per step (median us), without -> with each fast path", lines)


def _steady_real(args) -> int:
    t0 = time.perf_counter()
    engine = real_engine(args.steady, args.batch, args.context_tokens, args.device)
    ready_s = time.perf_counter() - t0
    row = steady_traffic(args.batch, args.context_tokens, 0.0, engine=engine)
    _steady_table([row])
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"engine-steady-{args.steady}-{stamp}.json"
    path.write_text(json.dumps({"date": stamp, "model": args.steady, "device": args.device, "device_name": device_name,
                                "ready_s": ready_s, "steady_traffic": row}, indent=2))
    print(f"\nwrote {path}")
    return 0


def _host_only(out: Path) -> int:
    rows = [host_work(b, 2048) for b in (64, 256, 512)]
    _host_table(rows)
    steady = [steady_traffic(b) for b in (64, 512)] + [steady_traffic(512, context=8192)]
    _steady_table(steady)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine-host-{stamp}-cpu.json"
    path.write_text(json.dumps({"date": stamp, "device_name": platform.processor() or "cpu", "host_work": rows,
                                "steady_traffic": steady},
                               indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
