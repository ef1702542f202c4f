"""The prefix cache's host tier on conversations that outgrow the GPU's K/V pool: time to first token and prompt
tokens computed with the cache off, the GPU cache alone, and the GPU cache with the host tier, in one process
(random weights of the real shapes); and the rate at which pages move between the GPU and host memory.

    python -m bench.host_kv_tier --model gpt-oss-20b --out bench/results/host_kv_tier_h200.json   (GPU)
    python -m bench.host_kv_tier --tiny --device cpu                                            (smoke run)

Workload: `--conversations` C conversations open with a `--context`-token prompt each; then `--turns` rounds
in which every conversation in turn sends its previous prompt and answer plus `--user` new tokens (one request
at a time, `--max-tokens` out, greedy). The GPU pool is sized for `--gpu-conversations` G < C of them (the
engine's own split of the bytes: the sliding pool keeps what a full batch needs, the full pool the rest), so
by a conversation's next turn the GPU has evicted its blocks; the host tier (`--host-mb`, default: room for
all of them) keeps them. Reported per run: TTFT mean and median over the turns after the opening round,
prompt tokens computed, prefix-cache hit tokens and, of those, the host tier's. Nothing is asserted about
speed. The tokens of the runs are compared: on the CPU (fp32) they must match; on the GPU the agreement is
reported (bf16: a suffix after a cached prefix runs other GEMM shapes than the whole prompt).

The copy rate: `--copy-pages` pages of both kinds moved to the host and back into other pages by the engine's
own `apply_kv_moves` (kernels/attention/kv_pages.py: one launch per batch), timed with CUDA events, with the
bytes checked to round-trip.

`--register-gib 4,16,32` (GPU) also times what a replica's start pays for a host tier of those sizes: the host
buffer's allocation and its registration with CUDA (every page faulted in and locked), and its release.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from bench.e2e import tiny_config
from engine.page_pool import cdiv
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerateRequest, SamplingParams
from model.config import GptOssConfig

MODES = ("off", "gpu", "gpu+host")


def page_bytes(shapes: GptOssConfig, block: int, element: int) -> tuple[int, int]:
    sliding = sum(shapes.is_sliding(i) for i in range(shapes.num_hidden_layers))
    full = shapes.num_hidden_layers - sliding
    return tuple(2 * n * block * shapes.num_key_value_heads * shapes.head_dim * element for n in (full, sliding))


def pool_pages(shapes: GptOssConfig, args) -> tuple[int, int]:
    """(full, sliding) pages: G conversations' longest prompts in the full pool; the sliding pool as the engine
    plans it from a byte budget (engine/runner.plan_pool_sizes: a full batch's windows and one chunk)."""
    bs = args.block
    full = args.gpu_conversations * cdiv(max_len(args), bs)
    sliding = args.max_seqs * (cdiv(shapes.sliding_window - 1, bs) + 2) + cdiv(args.chunk, bs)
    return full, sliding


def max_len(args) -> int:
    return args.context + args.turns * (args.user + args.max_tokens) + args.max_tokens


def conversation_run(engine: LLMEngine, args, vocab: int) -> tuple[list[float], list[list[int]]]:
    """TTFT (ms) of every turn after the opening round, and every request's output ids, in order."""
    g = torch.Generator().manual_seed(args.seed)
    history = [torch.randint(0, vocab, (args.context,), generator=g).tolist() for _ in range(args.conversations)]
    ttfts, outs = [], []
    for turn in range(args.turns + 1):
        for c in range(args.conversations):
            prompt = history[c] if turn == 0 else history[c] + torch.randint(0, vocab, (args.user,), generator=g).tolist()
            engine.add_request(GenerateRequest(f"c{c}-t{turn}-{time.monotonic_ns()}", prompt, SamplingParams(
                temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)))
            t0, first, ids = time.perf_counter(), None, []
            while engine.has_unfinished():
                for d in engine.step():
                    if first is None and d.token_ids:
                        first = time.perf_counter() - t0
                    ids += d.token_ids
            if turn:
                ttfts.append(1e3 * first)
            outs.append(ids)
            history[c] = prompt + ids
    return ttfts, outs


def copy_rate(engine: LLMEngine, pages: int) -> dict:
    """Pages 0..n-1 of both kinds to host slots 0..n-1, then back into pages n..2n-1: microseconds, GB/s and
    whether the bytes came back (run on an idle engine: it overwrites pages the block manager may still name)."""
    runner, cuda = engine.runner, engine.runner.device.type == "cuda"
    n = min(pages, min(t.shape[0] for t in runner.host_kv.k), min(t.shape[0] for t in runner.kv_cache.k) // 2)
    kinds = [k for k, present in (("full", runner.has_full), ("sliding", runner.has_sliding)) if present]
    for t in [*runner.kv_cache.k, *runner.kv_cache.v]:
        t[:n].view(torch.uint8).random_(0, 256)
    out = {"pages": n, "bytes": n * sum(runner.page_bytes())}
    for name, batches in (("to_host", [(k, True, list(range(n)), list(range(n))) for k in kinds]),
                          ("to_device", [(k, False, list(range(n, 2 * n)), list(range(n))) for k in kinds])):
        times = []
        for _ in range(5):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                runner.apply_kv_moves(batches)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                runner.apply_kv_moves(batches)
                times.append((time.perf_counter() - t0) * 1e6)
        us = statistics.median(times)
        out[name] = {"us": us, "GB_per_s": out["bytes"] / us / 1e3}
    out["round_trip_exact"] = all(torch.equal(t[:n].view(torch.uint8), t[n:2 * n].view(torch.uint8))
                                  for t in [*runner.kv_cache.k, *runner.kv_cache.v])
    return out


def registration_times(sizes_gib: list[float]) -> list[dict]:
    """Seconds to allocate and register (kernels/attention/kv_cache.RegisteredHostBuffer) and to release a host
    buffer of each size, as `PagedKVCache.allocate(pin_memory=True)` does at engine start."""
    from kernels.attention.kv_cache import RegisteredHostBuffer

    out = []
    for gib in sizes_gib:
        t0 = time.perf_counter()
        buffer = RegisteredHostBuffer(int(gib * 2**30), torch.uint8)
        registered = time.perf_counter() - t0
        t0 = time.perf_counter()
        buffer.release()
        del buffer
        gc.collect()
        out.append({"gib": gib, "register_s": registered, "release_s": time.perf_counter() - t0,
                    "GB_per_s": gib * 2**30 / registered / 1e9})
        print(f"host tier of {gib:g} GiB: allocated and registered in {registered:.2f} s "
              f"({out[-1]['GB_per_s']:.1f} GB/s), released in {out[-1]['release_s']:.2f} s")
    return out


def run(shapes: GptOssConfig, args, mode: str) -> dict:
    cuda = args.device.startswith("cuda")
    full, sliding = pool_pages(shapes, args)
    element = 2 if cuda else 4
    pair = sum(page_bytes(shapes, args.block, element))
    host = 0
    if mode == "gpu+host":
        host = args.host_mb * 2**20 if args.host_mb else \
            int(1.1 * args.conversations * cdiv(max_len(args), args.block) * pair)
    config = EngineConfig(device=args.device, dtype="bfloat16" if cuda else "float32", max_num_seqs=args.max_seqs,
                          max_num_batched_tokens=args.chunk, max_model_len=max_len(args), block_size=args.block,
                          num_full_pages=full, num_sliding_pages=sliding, cuda_graphs=cuda,
                          enable_prefix_caching=mode != "off", host_kv_cache_bytes=host)
    t0 = time.perf_counter()
    engine = LLMEngine.with_random_weights(shapes, config, seed=args.seed)
    build_s = time.perf_counter() - t0
    try:
        engine.generate([GenerateRequest("warm", list(range(1, args.user + 2)),
                                         SamplingParams(temperature=0.0, max_tokens=2))])  # JIT, first launches
        engine.reset_metrics()
        ttfts, outs = conversation_run(engine, args, shapes.vocab_size)
        snap, usage = engine.metrics.snapshot(), engine.block_manager.usage()
        record = {"mode": mode, "engine_build_s": build_s, "host_bytes": host, "full_pages": full,
                  "sliding_pages": sliding, "ttft_ms_mean": statistics.mean(ttfts),
                  "ttft_ms_median": statistics.median(ttfts), "prefill_tokens": snap["prefill_tokens_total"],
                  "hit_tokens": usage.get("prefix_hit_tokens", 0), "host_hit_tokens": usage.get("host_hit_tokens", 0),
                  "host_pages_stored": usage.get("host_pages_stored", 0),
                  "host_pages_loaded": usage.get("host_pages_loaded", 0), "output_ids": outs}
        if host:
            record["copy"] = copy_rate(engine, args.copy_pages)
        return record
    finally:
        engine.close()
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--gpu-conversations", type=int, default=4, help="conversations the GPU's full pool holds")
    p.add_argument("--context", type=int, default=4096, help="tokens of each conversation's opening prompt")
    p.add_argument("--turns", type=int, default=2, help="rounds after the opening one")
    p.add_argument("--user", type=int, default=256, help="new tokens per turn")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--max-seqs", type=int, default=4, help="max_num_seqs")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--host-mb", type=int, default=0, help="host tier MiB per rank (0: room for every conversation)")
    p.add_argument("--copy-pages", type=int, default=1024, help="pages of each kind in the copy-rate test")
    p.add_argument("--modes", default=",".join(MODES), help=f"runs, comma-separated, of {MODES}")
    p.add_argument("--register-gib", default="", help="host tier sizes (GiB) to time allocation + registration of")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/host_kv_tier.json")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes takes some of {MODES}, got {args.modes!r}")
    if args.tiny:
        shapes = tiny_config()
        args.conversations, args.gpu_conversations, args.context = min(args.conversations, 4), \
            min(args.gpu_conversations, 1), min(args.context, 96)
        args.user, args.max_tokens, args.chunk, args.copy_pages = min(args.user, 9), min(args.max_tokens, 3), \
            min(args.chunk, 64), min(args.copy_pages, 8)
    else:
        shapes = GptOssConfig.preset(args.model)
    registration = registration_times([float(x) for x in args.register_gib.split(",") if x]) \
        if args.register_gib and args.device.startswith("cuda") else []
    runs = [run(shapes, args, mode) for mode in modes]
    same = all(r["output_ids"] == runs[0]["output_ids"] for r in runs[1:])
    agree = {r["mode"]: sum(a == b for a, b in zip(runs[0]["output_ids"], r["output_ids"])) for r in runs[1:]}
    # (agreement is with the first run, which is the uncached one unless --modes leaves it out)
    record = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": "tiny" if args.tiny else args.model,
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "args": vars(args), "runs": runs, "same_tokens": same, "requests_agreeing_with_first_run": agree,
              "requests": len(runs[0]["output_ids"]), "registration": registration}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"{args.conversations} conversations of {args.context} tokens + {args.turns} turns of {args.user} "
          f"(+{args.max_tokens} out); the GPU pool holds {args.gpu_conversations}")
    print(f"{'cache':>9s} {'TTFT mean ms':>12s} {'median':>8s} {'prefill tok':>11s} {'hits':>8s} {'from host':>9s} "
          f"{'stored':>7s} {'loaded':>7s}")
    for r in runs:
        print(f"{r['mode']:>9s} {r['ttft_ms_mean']:12.2f} {r['ttft_ms_median']:8.2f} {r['prefill_tokens']:11d} "
              f"{r['hit_tokens']:8d} {r['host_hit_tokens']:9d} {r['host_pages_stored']:7d} {r['host_pages_loaded']:7d}")
    copy = runs[-1].get("copy")
    if copy:
        print(f"copy {copy['pages']} page pairs ({copy['bytes'] / 2**20:.1f} MiB): to host {copy['to_host']['us']:.0f} us "
              f"({copy['to_host']['GB_per_s']:.1f} GB/s), back {copy['to_device']['us']:.0f} us "
              f"({copy['to_device']['GB_per_s']:.1f} GB/s), bytes round-trip: {copy['round_trip_exact']}")
    print(f"same tokens in every run: {same} (requests agreeing with the first run ({runs[0]['mode']}): {agree} of "
          f"{record['requests']})\nwrote {out}")
    ok = copy is None or copy["round_trip_exact"]
    return 0 if ok and (same or args.device.startswith("cuda")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
