"""Prefill on some GPUs, decode on others (issue 10): two engines and the GPU-direct K/V hand-off between
them, against one engine doing both.

    python -m bench.disaggregated --model gpt-oss-120b --tp 2 --ep 2 --prefill-device cuda:0 \\
        --decode-device cuda:2 --out bench/results/disaggregated.json            (a 4-GPU host)
    python -m bench.disaggregated --tiny --device cpu --tp 2 --ep 2           (CPU smoke run over gloo)

A spawned process runs the prefill engine (prefill_only requests, export_kv, then CudaIpcTransport.send
into the decode process's arena, as the Serve prefill replica does); this process runs the decode engine
(offer, receive, import_prefilled, decode). Per prompt length: the prefill engine's time to its token,
the hand-off (bytes, send and receive ms, GB/s), TTFT at the decode side (request -> first token there)
and the time per output token after it; then the same prompt through the decode engine alone (one engine
doing both): its TTFT and time per output token. On CPU the K/V travels through the process queue.
Both engines draw random weights of the real shapes from the same seed with the same split, so they
hold the same model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import pstats
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.e2e import tiny_config
from bench.e2e_engine_runs import timed_single
from bench.parallel import prompt
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerateRequest, SamplingParams
from model.config import GptOssConfig


@dataclass(frozen=True)
class Side:
    shapes: GptOssConfig
    config: EngineConfig
    seed: int
    profile: str = ""  # "python" (cProfile) or "ops" (torch.profiler): print a profile of each export + send


def engine_config(args, device: str, longest: int) -> EngineConfig:
    return EngineConfig(device=device, dtype=args.dtype, tp_size=args.tp, ep_size=args.ep, max_num_seqs=4,
                        max_num_batched_tokens=max(args.chunk, 4), max_model_len=longest,
                        kv_cache_bytes=args.kv_cache_mb * 2**20 if args.kv_cache_mb else None,
                        cuda_graphs=device.startswith("cuda"))


def _prefill_side(side: Side, jobs, results) -> None:
    """The prefill process: one job (request, offer) at a time, answered with the K/V handle
    (CUDA) or the payload itself (CPU) and its timings."""
    from serve_app.kv_transfer import CudaIpcTransport

    engine = LLMEngine.with_random_weights(side.shapes, side.config, side.seed)
    cuda = side.config.device.startswith("cuda")
    transport = CudaIpcTransport(side.config.device, arena_bytes=1) if cuda else None
    results.put(("ready", None, {}))
    try:
        while (job := jobs.get()) is not None:
            request, offer = job
            rid = request.request_id
            try:
                t0 = time.perf_counter()
                engine.add_request(request, prefill_only=True)
                while engine.has_unfinished():
                    engine.step_prefill()
                t1 = time.perf_counter()
                prof = cProfile.Profile() if side.profile == "python" else None
                ops = torch.profiler.profile() if side.profile == "ops" else contextlib.nullcontext()
                if prof:
                    prof.enable()
                with ops:
                    payload = engine.export_kv(rid, transport.export_target(offer) if cuda else None)
                    if cuda:
                        torch.cuda.synchronize(engine.runner.device)
                    t2 = time.perf_counter()
                    out = transport.send(payload, offer) if cuda else payload
                    t3 = time.perf_counter()
                if prof:
                    prof.disable()
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(18)
                    print(f"export + send of {len(request.prompt_ids)} tokens, host profile:\n{text.getvalue()}",
                          flush=True)
                if side.profile == "ops":
                    print(f"export + send of {len(request.prompt_ids)} tokens, ops:\n"
                          + ops.key_averages().table(sort_by="cpu_time_total", row_limit=16), flush=True)
                results.put(("ok", out, {"prefill_ms": (t1 - t0) * 1e3, "export_ms": (t2 - t1) * 1e3,
                                         "send_ms": (t3 - t1) * 1e3, "copy_ms": (t3 - t2) * 1e3}))
            except Exception as exc:  # reported to the decode side, which fails the run with it
                results.put(("error", repr(exc), {}))
    finally:
        engine.close()


def start_prefill_process(side: Side):
    """(process, jobs, results): the prefill side running _prefill_side; wait_ready before sending jobs."""
    ctx = torch.multiprocessing.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_prefill_side, args=(side, jobs, results))
    proc.start()
    return proc, jobs, results


def stop_both(proc, jobs, decode: LLMEngine) -> None:
    """End the prefill process (killed if it does not stop) and close the decode engine."""
    jobs.put(None)
    proc.join(120)
    if proc.is_alive():
        proc.kill()
    decode.close()


def wait_ready(results) -> None:
    status, detail, _ = results.get(timeout=900)
    if status != "ready":
        raise RuntimeError(f"the prefill process failed to start: {detail}")


def kv_bound(shapes: GptOssConfig, dtype_name: str, prompt_len: int) -> int:
    """Bytes a prompt's K/V hand-off can take (the decode side's offer)."""
    from serve_app.kv_transfer import payload_upper_bound

    sliding = [shapes.is_sliding(i) for i in range(shapes.num_hidden_layers)]
    dtype = torch.bfloat16 if dtype_name == "bfloat16" else torch.float32
    return payload_upper_bound(prompt_len, shapes.num_hidden_layers, sliding, shapes.sliding_window,
                               shapes.num_key_value_heads, shapes.head_dim, dtype)


def handoff(decode: LLMEngine, transport, jobs, results, req: GenerateRequest, bound: int) -> dict:
    t0 = time.perf_counter()
    offer = transport.offer(bound) if transport else None
    jobs.put((req, offer))
    status, got, times = results.get(timeout=600)
    if status != "ok":
        raise RuntimeError(f"the prefill process failed: {got}")
    t1 = time.perf_counter()
    payload = asyncio.run(transport.receive(got, offer, timeout_s=60)) if transport else got
    nbytes = got.nbytes if transport else sum(t.numel() * t.element_size() for t in (*payload.k, *payload.v))
    if transport:
        torch.cuda.synchronize(decode.runner.device)
    t2 = time.perf_counter()
    deltas = decode.import_prefilled(req, payload)
    ids = [t for d in deltas for t in d.token_ids]
    stamps = [time.perf_counter()] * len(ids)
    import_ms = (stamps[0] - t2) * 1e3 if stamps else None
    if transport:
        transport.release(offer)
    while decode.has_unfinished():
        for d in decode.step():
            stamps += [time.perf_counter()] * len(d.token_ids)
            ids += d.token_ids
    rec = {"in_len": len(req.prompt_ids), "out_len": len(stamps), "kv_bytes": nbytes, **times,
           "receive_ms": (t2 - t1) * 1e3, "import_ms": import_ms, "ttft_ms": (stamps[0] - t0) * 1e3,
           "output_ids": ids}
    rec["handoff_GBps"] = nbytes / ((times["send_ms"] + rec["receive_ms"]) / 1e3) / 1e9
    if len(stamps) > 1:
        rec["tpot_ms"] = (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3
    return rec


def main(argv=None) -> int:
    from serve_app.kv_transfer import CudaIpcTransport

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-oss-120b")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and lengths (CPU smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, or cuda (then --prefill-device / --decode-device place the two engines)")
    p.add_argument("--prefill-device", default="cuda:0")
    p.add_argument("--decode-device", default="cuda:2")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--prompts", default="1024,8192")
    p.add_argument("--out-len", type=int, default=64)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--kv-cache-mb", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-export", choices=["", "python", "ops"], default="",
                   help="profile the prefill side's export + send: python (cProfile) or ops (torch.profiler)")
    p.add_argument("--out", default="bench/results/disaggregated.json")
    args = p.parse_args(argv)
    shapes = tiny_config() if args.tiny else GptOssConfig.preset(args.model)
    prompts = [24, 40] if args.tiny else [int(n) for n in args.prompts.split(",")]
    out_len = 6 if args.tiny else args.out_len
    cuda = args.device.startswith("cuda")
    pre_dev, dec_dev = (args.prefill_device, args.decode_device) if cuda else ("cpu", "cpu")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cuda else "float32"
    longest = max(prompts) + out_len + 16
    proc, jobs, results = start_prefill_process(Side(shapes, engine_config(args, pre_dev, longest), args.seed,
                                                     args.profile_export))
    decode = LLMEngine.with_random_weights(shapes, engine_config(args, dec_dev, longest), args.seed)
    record = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": "tiny" if args.tiny else args.model,
              "tp": args.tp, "ep": args.ep, "prefill_device": pre_dev, "decode_device": dec_dev, "rows": []}
    try:
        wait_ready(results)
        bounds = {n: kv_bound(shapes, args.dtype, n) for n in prompts}
        transport = CudaIpcTransport(dec_dev, arena_bytes=max(bounds.values()) + 2**20) if cuda else None
        timed_single(decode, prompt(16, shapes.vocab_size, 1), 2)  # warm-up
        handoff(decode, transport, jobs, results, GenerateRequest("warm", prompt(16, shapes.vocab_size, 1), SamplingParams(
            temperature=0.0, max_tokens=2, ignore_eos=True)), bounds[min(prompts)])
        for n in prompts:
            ids = prompt(n, shapes.vocab_size, 7 + n)
            req = GenerateRequest(f"p{n}", ids, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
            row = {"disaggregated": handoff(decode, transport, jobs, results, req, bounds[n]),
                   "one_engine": timed_single(decode, ids, out_len)}
            row["same_tokens"] = row["disaggregated"]["output_ids"] == row["one_engine"]["output_ids"]
            record["rows"].append(row)
            d, o = row["disaggregated"], row["one_engine"]
            if "export_ms" in d:
                print(f"[{n} tokens] prefill side: export {d['export_ms']:.2f} ms, copy {d['copy_ms']:.2f} ms; decode "
                      f"side: receive {d['receive_ms']:.2f} ms, import {d['import_ms']:.2f} ms", flush=True)
            print(f"[{n} tokens] hand-off {d['kv_bytes'] / 2**20:.1f} MiB at {d['handoff_GBps']:.1f} GB/s | TTFT "
                  f"{d['ttft_ms']:.1f} ms split vs {o['ttft_ms']:.1f} ms one engine | ms/token {d.get('tpot_ms', 0):.3f} "
                  f"vs {o.get('tpot_ms', 0):.3f} | same tokens: {row['same_tokens']}", flush=True)
    finally:
        stop_both(proc, jobs, decode)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
