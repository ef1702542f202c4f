"""Prefill on one GPU and decode on another, under a burst of requests, against each GPU doing both.

    python -m bench.disaggregated_load --model gpt-oss-20b --requests 16 --prompt-len 8192 --out-len 256 \\
        --prefill-device cuda:0 --decode-device cuda:1 --out bench/results/disaggregated_load.json
    python -m bench.disaggregated_load --tiny --device cpu          (CPU smoke run)

bench/disaggregated.py times one request at a time; this one sends `--requests` prompts at once, which
is where splitting prefill from decode is meant to pay: a GPU that does both runs every prompt chunk in
the same steps as its decoding sequences, so their tokens wait for the chunk; a decode-only GPU never
does. Two setups on the same 2 GPUs, random weights of the real shapes, greedy, `ignore_eos`:

- split: a spawned process runs the prefill engine (as bench/disaggregated.py's, one prompt at a time,
  exporting over CUDA IPC as each finishes); this process runs the decode engine, importing each K/V as
  it arrives and stepping all imported requests together.
- both (data-parallel): one engine doing prefill and decode gets half the requests at once (chunked
  prefill, mixed steps); the other GPU would run the other half the same way, so its numbers stand for
  both GPUs (throughput doubled).

Prefix caching is off (both setups run the same prompts) and each setup is warmed up first with prompts
of the measured length (first chunks and mixed steps of a shape compile kernels). Per setup: time to first token (request sent -> first token on the decode side), the time between a
request's consecutive tokens (inter-token latency, all gaps of all requests), and output tokens per
second over the 2 GPUs (last token's time). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import queue
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.disaggregated import Side, engine_config, kv_bound, start_prefill_process, stop_both, wait_ready
from bench.e2e import tiny_config
from bench.parallel import prompt
from engine.llm_engine import LLMEngine
from engine.request import GenerateRequest, SamplingParams
from model.config import GptOssConfig
from serve_app.kv_transfer import CudaIpcTransport


def requests(n: int, prompt_len: int, out_len: int, vocab: int, tag: str, seed: int = 1000) -> list[GenerateRequest]:
    return [GenerateRequest(f"{tag}{i}", prompt(prompt_len, vocab, seed + i), SamplingParams(
        temperature=0.0, max_tokens=out_len, ignore_eos=True)) for i in range(n)]


def summarize(t0: float, stamps: dict[str, list[float]], gpus: int, copies: int) -> dict:
    """TTFT and inter-token gaps (ms) from per-request token timestamps; output tok/s over `gpus` GPUs when
    the measured engine stands for `copies` identical ones."""
    ttft = sorted((s[0] - t0) * 1e3 for s in stamps.values())
    gaps = sorted((b - a) * 1e3 for s in stamps.values() for a, b in zip(s, s[1:]))
    tokens = sum(len(s) for s in stamps.values())
    end = max(s[-1] for s in stamps.values())

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    where = sorted(((b - a) * 1e3, rid, i + 1) for rid, s in stamps.items() for i, (a, b) in enumerate(zip(s, s[1:])))
    return {"largest_gaps": [{"ms": g, "request": rid, "token": i} for g, rid, i in where[-4:][::-1]],
            "requests": len(stamps), "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p90": pct(ttft, 0.9),
            "ttft_ms_max": ttft[-1], "itl_ms_p50": statistics.median(gaps), "itl_ms_p90": pct(gaps, 0.9),
            "itl_ms_p99": pct(gaps, 0.99), "itl_ms_max": gaps[-1], "makespan_s": end - t0,
            "output_tok_s": copies * tokens / (end - t0), "gpus": gpus}


def run_split(decode: LLMEngine, transport, jobs, results, reqs: list[GenerateRequest], bound: int,
              timeout_s: float) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Every prompt to the prefill process at once; import each K/V as it comes back; decode throughout.
    Returns per request its tokens' timestamps and ids."""
    offers = {r.request_id: transport.offer(bound) if transport else None for r in reqs}
    by_id = {r.request_id: r for r in reqs}
    stamps: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    ids: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        jobs.put((r, offers[r.request_id]))
    waiting, deadline = len(reqs), time.monotonic() + timeout_s
    while waiting or decode.has_unfinished():
        if time.monotonic() > deadline:
            raise TimeoutError(f"split run did not finish in {timeout_s} s")
        while waiting:
            try:  # block only when there is nothing to decode
                status, got, _ = results.get(timeout=600 if not decode.has_unfinished() else 0.0005)
            except queue.Empty:
                break
            if status != "ok":
                raise RuntimeError(f"the prefill process failed: {got}")
            waiting -= 1
            rid = got.skeleton.request_id if transport else got.request_id
            payload = asyncio.run(transport.receive(got, offers[rid], timeout_s=60)) if transport else got
            for d in decode.import_prefilled(by_id[rid], payload):
                stamps[rid] += [time.perf_counter()] * len(d.token_ids)
                ids[rid] += d.token_ids
            if transport:
                transport.release(offers[rid])
        if decode.has_unfinished():
            for d in decode.step():
                stamps[d.request_id] += [time.perf_counter()] * len(d.token_ids)
                ids[d.request_id] += d.token_ids
    return stamps, ids


def run_both(engine: LLMEngine, reqs: list[GenerateRequest]) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    stamps: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    ids: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        for d in engine.step():
            stamps[d.request_id] += [time.perf_counter()] * len(d.token_ids)
            ids[d.request_id] += d.token_ids
    return stamps, ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prefill-device", default="cuda:0")
    p.add_argument("--decode-device", default="cuda:1")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--out-len", type=int, default=256)
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens of every engine")
    p.add_argument("--kv-cache-mb", type=int)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=400)
    p.add_argument("--profile-both", action="store_true", help="cProfile the timed both-run (where its stalls go)")
    p.add_argument("--out", default="bench/results/disaggregated_load.json")
    args = p.parse_args(argv)
    args.tp = args.ep = 1
    shapes = tiny_config() if args.tiny else GptOssConfig.preset(args.model)
    if args.tiny:
        args.requests, args.prompt_len, args.out_len = min(args.requests, 4), 40, 6
    cuda = args.device.startswith("cuda")
    pre_dev, dec_dev = (args.prefill_device, args.decode_device) if cuda else ("cpu", "cpu")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cuda else "float32"
    longest = args.prompt_len + args.out_len + 16

    def config(device: str):  # no prefix caching: both setups run the same prompts
        return replace(engine_config(args, device, longest), max_num_seqs=max(4, args.requests),
                       enable_prefix_caching=False)

    proc, jobs, results = start_prefill_process(Side(shapes, config(pre_dev), args.seed))
    decode = LLMEngine.with_random_weights(shapes, config(dec_dev), args.seed)
    record = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": "tiny" if args.tiny else args.model,
              "prefill_device": pre_dev, "decode_device": dec_dev, "requests": args.requests,
              "prompt_len": args.prompt_len, "out_len": args.out_len, "chunk": args.chunk}
    try:
        wait_ready(results)
        bound = kv_bound(shapes, args.dtype, args.prompt_len)
        transport = CudaIpcTransport(dec_dev, arena_bytes=args.requests * bound + 2**20) if cuda else None
        vocab = shapes.vocab_size
        # Warm-ups at the measured prompt length: the first prompt chunks and mixed steps of a shape compile
        # kernels (Triton, DeepGEMM) that would otherwise land inside the timed runs.
        run_split(decode, transport, jobs, results, requests(2, args.prompt_len, 4, vocab, "warm", seed=50), bound,
                  args.timeout_s)
        run_both(decode, requests(3, args.prompt_len, 4, vocab, "warmboth", seed=60))
        t0 = time.perf_counter()
        split, split_ids = run_split(decode, transport, jobs, results, requests(
            args.requests, args.prompt_len, args.out_len, vocab, "s"), bound, args.timeout_s)
        record["split"] = summarize(t0, split, gpus=2, copies=1)
        prof = cProfile.Profile() if args.profile_both else None
        compiled: list[str] = []
        if prof:
            import triton

            def record_compile(**kw):  # Triton calls this before it compiles a kernel variant
                compiled.append(str(kw.get("repr", "?"))[:300])
                return False

            triton.knobs.runtime.jit_cache_hook = record_compile
            prof.enable()
        t0 = time.perf_counter()
        both, both_ids = run_both(decode, requests(args.requests // 2, args.prompt_len, args.out_len, vocab, "b"))
        if prof:
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            print(f"host profile of the timed both-run (by own time):\n{text.getvalue()}", flush=True)
            print(f"Triton kernel variants compiled inside the timed both-run: {len(compiled)}", flush=True)
            for c in compiled:
                print("  " + c, flush=True)
        record["both"] = summarize(t0, both, gpus=2, copies=2)
        # the same prompts (seeds) give the same greedy tokens whichever way they ran (exact on CPU; on GPUs
        # batching changes bf16 rounding, so near-ties may differ)
        record["tokens_per_request"] = sorted({len(v) for v in (*split_ids.values(), *both_ids.values())})
        record["same_tokens"] = sum(split_ids[f"s{i}"] == both_ids[f"b{i}"] for i in range(args.requests // 2))
    finally:
        stop_both(proc, jobs, decode)
    print(f"{args.requests} requests x {args.prompt_len} in / {args.out_len} out, {record['model']}, 2 GPUs:")
    print(f"{'setup':>26} {'TTFT p50':>9} {'p90':>8} {'max':>8} {'ITL p50':>8} {'p90':>7} {'p99':>7} {'max':>8} {'tok/s':>8}")
    for key, name in (("split", "prefill GPU + decode GPU"), ("both", "each GPU both (DP2)")):
        r = record[key]
        print(f"{name:>26} {r['ttft_ms_p50']:>9.1f} {r['ttft_ms_p90']:>8.1f} {r['ttft_ms_max']:>8.1f} "
              f"{r['itl_ms_p50']:>8.2f} {r['itl_ms_p90']:>7.2f} {r['itl_ms_p99']:>7.2f} {r['itl_ms_max']:>8.1f} "
              f"{r['output_tok_s']:>8.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    for key in ("split", "both"):
        print(f"{key}: largest gaps (ms, request, token index): "
              + ", ".join(f"{g['ms']:.1f} {g['request']} #{g['token']}" for g in record[key]["largest_gaps"]))
    print(f"requests with the same tokens both ways: {record['same_tokens']} of {args.requests // 2}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
