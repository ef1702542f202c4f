"""bench/e2e's measured throughput: the 1k/1k and 8k/1k scenarios through LLMEngine for real.

The estimates in bench/e2e (`throughput_point`) combine a measured decode step with a measured prefill
rate; this runs the same batch of requests through the engine: continuous batching, chunked prefill
mixed with decode (mixed steps run eagerly, pure decode steps replay CUDA graphs), the sampler, the
scheduler's host time, page allocation and freeing. All requests arrive at once (the estimate's batch,
random prompt ids, greedy, ignore_eos, exactly out_len tokens each); output tok/s = all output tokens /
wall time from the first prefill to the last token.

"b1" runs one request alone (1024 prompt tokens, 256 output tokens, greedy): time to first token and
time per output token through the engine's whole step (schedule, metadata, graph replay, sampler, one
device-to-host read, bookkeeping), next to the graph-replay-only decode points of the tables; with the
engine's decode lookahead as configured (on with one CUDA device). "b1sync" runs it again with the
lookahead off (engine/llm_engine.py), in the same engine. The engine is warmed up first (engine/warm_up.py), as a
Serve replica is (since 2026-12-01; earlier b1 TTFTs of a fresh engine included compiling kernels).
"""

from __future__ import annotations

import gc
import time

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_factory import segments_max_rows_of
from engine.request import GenerateRequest, SamplingParams
from engine.warm_up import warm_up

DEFAULT_CPU_BUDGET = 256 * 2**20
B1_IN, B1_OUT = 1024, 256


def uses_cuda_front(engine: LLMEngine) -> bool:
    """Whether the engine's model routes single-token steps through the CUDA cluster front (decode_front)."""
    return any(getattr(m, "cuda_front", False) for m in engine.model.modules())


def engine_runs(h, r: dict, args, clock, save, scenarios: dict) -> None:
    """Run each scenario in `args.engine_runs` (name -> (in_len, out_len, mean ctx)) whose estimate is in
    r["throughput"], at the estimate's batch; results in r["engine_runs"]. Frees the harness's KV pool and
    graphs first: the engine allocates its own pool (same headroom) and captures its own graphs."""
    wanted = [s for s in args.engine_runs.split(",") if s]
    estimates = {p["scenario"]: p for p in r["throughput"] if p["scenario"] in wanted}
    single = [w for w in wanted if w in ("b1", "b1sync")]
    if not estimates and not single:
        return
    h.release()
    device = h.device
    # CUDA: the pool takes what is free but the headroom, and never what the engine's own estimate of its largest
    # step needs (engine/memory_budget.py: a fixed 4 GB left 120b at 512 requests x 8k chunks ~0.5 GB short at
    # prefill-graph capture on 2026-12-04); CPU: a fixed pool
    budget, fraction = DEFAULT_CPU_BUDGET, 0.9
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        budget, fraction = None, max(1e-3, 1 - args.headroom_gb * 2**30 / free)
    longest = max([scenarios[s][0] + scenarios[s][1] for s in estimates] + [B1_IN + B1_OUT])
    max_seqs = max([p["batch"] for p in estimates.values()] + [1])
    config = EngineConfig(device=str(device), max_num_seqs=max_seqs,
                          max_num_batched_tokens=max(args.prefill_chunk, max_seqs), max_model_len=longest,
                          kv_cache_bytes=budget, gpu_memory_fraction=fraction, kv_cache_dtype=args.kv_cache_dtype,
                          cuda_graphs=device.type == "cuda",
                          prefill_graphs=None if args.prefill_graphs else False,
                          lm_head_dtype=args.lm_head_dtype, mxfp4_decode_max_tokens=args.mxfp4_decode_max_tokens,
                          dense_dtype=args.dense_dtype, decode_front=args.decode_front)
    t0 = time.perf_counter()
    engine = LLMEngine(h.model, config)
    runs = r.setdefault("engine_runs", [])
    setup = {"engine_build_s": time.perf_counter() - t0, "graph_capture_s": sum(engine.graph_capture_seconds.values()),
             "prefill_graph_capture_s": sum(engine.prefill_graph_capture_seconds.values()),
             "full_pages": engine.block_manager.usage()["full_pages_total"]}
    # as a Serve replica does before its first request (engine/warm_up.py): the b1 TTFT is then no compile's
    setup["engine_warm_up_s"] = warm_up(engine)["seconds"]
    auto = engine.async_decode
    for name in single:
        engine.async_decode = auto and name == "b1"
        runs.append(single_request(engine, h, device, setup, name))
        save()
    engine.async_decode = auto
    if estimates:  # untimed: the first mixed steps compile what graph capture did not run (eager attention)
        first = next(iter(estimates))
        in_len, count = scenarios[first][0], min(64, estimates[first]["batch"])
        gen = torch.Generator().manual_seed(12345)
        t = time.perf_counter()
        engine.generate([GenerateRequest(f"warmup-{i}", torch.randint(0, h.config.vocab_size, (in_len,), generator=gen)
                                         .tolist(), SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(count)])
        setup["warmup_s"] = time.perf_counter() - t
    for scenario, estimate in estimates.items():
        in_len, out_len, _ = scenarios[scenario]
        batch = estimate["batch"]
        if clock.left() < 1.5 * estimate["cycle_s"] + 20:
            runs.append({"scenario": scenario, "skipped": f"needs ~{estimate['cycle_s']:.0f} s, "
                                                          f"{clock.left():.0f} s left"})
            continue
        gen = torch.Generator().manual_seed(len(runs))
        reqs = [GenerateRequest(f"{scenario}-{i}", torch.randint(0, h.config.vocab_size, (in_len,), generator=gen).tolist(),
                                SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
                for i in range(batch)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        try:
            outs = engine.generate(reqs)
        except Exception as exc:  # recorded like a failing bench point; the engine is not reused
            runs.append({"scenario": scenario, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(f"[{h.name}] engine run {scenario} failed: {exc}", flush=True)
            save()
            break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t
        tokens = sum(len(o.output_ids) for o in outs)
        point = {"scenario": scenario, "requests": batch, "in_len": in_len, "out_len": out_len, "wall_s": wall,
                 "output_tokens": tokens, "output_tok_s": tokens / wall, "total_tok_s": (tokens + batch * in_len) / wall,
                 "estimate_output_tok_s": estimate["output_tok_s"], "kv_cache_dtype": args.kv_cache_dtype,
                 "lm_head_dtype": args.lm_head_dtype, "dense_dtype": args.dense_dtype,
                 "decode_front": "cuda" if uses_cuda_front(engine) else "triton",
                 "mxfp4_decode_max_tokens": args.mxfp4_decode_max_tokens,
                 "moe_segments_max_rows": segments_max_rows_of(engine.model),
                 "async_decode": engine.async_decode, "lookahead_steps": engine.lookahead_steps,
                 "method": "measured: LLMEngine.generate over the batch, all requests at once", **setup}
        runs.append(point)
        print(f"[{h.name}] engine run {scenario}: {point['output_tok_s']:.0f} output tok/s/GPU "
              f"({batch} requests, {wall:.1f} s; estimate {estimate['output_tok_s']:.0f})", flush=True)
        save()
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_single(engine: LLMEngine, ids: list[int], max_tokens: int) -> dict:
    """One request alone, stepped here: TTFT, and the mean time between its later tokens (tpot_ms,
    tok_s_user) when there are several; its output ids."""
    engine.add_request(GenerateRequest(f"single{time.monotonic_ns()}", ids, SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    times, out = [], []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for d in engine.step():
            times += [time.perf_counter()] * len(d.token_ids)
            out += d.token_ids
    point = {"in_len": len(ids), "out_len": len(times), "ttft_ms": 1e3 * (times[0] - t0), "output_ids": out}
    if len(times) > 1:
        tpot = (times[-1] - times[0]) / (len(times) - 1)
        point.update(tpot_ms=1e3 * tpot, tok_s_user=1 / tpot)
    return point


def single_request(engine: LLMEngine, h, device, setup: dict, name: str = "b1") -> dict:
    """One request alone through the engine: TTFT and time per output token, step by step."""
    prompt = torch.randint(0, h.config.vocab_size, (B1_IN,), generator=torch.Generator().manual_seed(9)).tolist()
    ahead = engine.lookahead_steps
    timed = timed_single(engine, prompt, B1_OUT)
    timed.pop("output_ids")
    point = {"scenario": name, "requests": 1, **timed, "kv_cache_dtype": engine.config.kv_cache_dtype,
             "lm_head_dtype": engine.config.lm_head_dtype, "dense_dtype": engine.config.dense_dtype,
             "decode_front": "cuda" if uses_cuda_front(engine) else "triton",
             "mxfp4_decode_max_tokens": engine.config.mxfp4_decode_max_tokens,
             "moe_segments_max_rows": segments_max_rows_of(engine.model),
             "async_decode": engine.async_decode, "lookahead_steps": engine.lookahead_steps - ahead,
             "method": "measured: one request through LLMEngine.step (host work included)", **setup}
    print(f"[{h.name}] engine run {name} (lookahead {engine.async_decode}): TTFT {point['ttft_ms']:.1f} ms, {point['tok_s_user']:.0f} tok/s "
          f"({point['tpot_ms']:.3f} ms per output token)", flush=True)
    return point
