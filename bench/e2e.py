"""End to end on one GPU: prefill TTFT and decode speed/cost for gpt-oss-20b and gpt-oss-120b.

    python -m bench.e2e --device cuda --out bench/results/e2e_h200.json      (the H200 run)
    python -m bench.e2e --device cpu --tiny                                  (smoke test of the code)
    python -m bench.e2e --checkpoint /path/to/gpt-oss-20b                    (real weights)

Weights are random with the real shapes, made on the device (engine/model_factory.py), or loaded from
`--checkpoint`: FP8 experts (DeepGEMM / Triton grouped GEMMs), bf16 dense layers, FlashInfer sink
prefill, our Triton split-KV decode.

- prefill: batch 1, one forward over N tokens written into the paged cache, plus the last row's
  logits; median of 3 back to back after a warm-up (ttft_ms), and median of 3 each after 0.3 s of GPU idle
  (ttft_after_rest_ms: a prefill runs at the power cap, so a rested GPU is faster; bench/power_probe.py).
  TTFT excludes queueing and sampling (~0.1 ms).
- decode: SYNTHETIC contexts: K/V pages are filled with random values and sequence lengths set to
  the context, instead of prefilling 32k tokens per sequence. Each sequence owns its own pages (no
  page sharing, so K/V bytes really stream). A step = plan (host) + CUDA-graph replay + argmax;
  the argmax feeds the next step's ids. tok/s per user = 1 / step, per GPU = batch / step.
- max throughput at 1k/1k and 8k/1k is ESTIMATED from the measured prefill rate and decode steps at
  the largest captured batch that fits (bench/e2e_costs.estimate_throughput); with --engine-runs the
  same batches also go through LLMEngine and are MEASURED (bench/e2e_engine_runs.py).
- --kv-cache-dtype fp8_e4m3: float8 K/V pages (twice the sequences per GiB; off the reference's numerics).
- per point: top kernels (torch.profiler over one eager step: graphs hide kernel names) and the
  fraction of the roofline (bench/e2e_costs.py).
A time guard stops adding points when --budget-s is spent; JSON is rewritten after every point.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path

import torch

from bench import e2e_costs as costs
from bench.e2e_engine_runs import engine_runs
from bench.e2e_timing import Clock, sync, timed, timed_after_rest, top_kernels
from engine.cuda_graphs import DecodeGraphs, default_buckets
from engine.memory_budget import activation_bytes
from engine.model_factory import build_model, segments_max_rows_of
from kernels.attention import AttentionBatch, KVGroupMeta, PagedKVCache
from kernels.attention.kv_cache import KV_CACHE_DTYPES, is_fp8, resolve_kv_dtype
from model.config import GptOssConfig

BLOCK = 16
PREFILL_LENS = [1024, 2048, 4096, 8192, 16384, 32768]
CONTEXTS = [8192, 32768]
# Decode contexts of the throughput estimates: the mean context over a 1k/1k and an 8k/1k request.
THROUGHPUT = {"1k/1k": (1024, 1024, 1536), "8k/1k": (8192, 1024, 8704)}


def tiny_config() -> GptOssConfig:
    """A small GPT-OSS for the CPU smoke run (and the GPU tests): every code path, none of the size."""
    return GptOssConfig(num_hidden_layers=4, num_local_experts=8, vocab_size=2048, hidden_size=256,
                        intermediate_size=256, num_attention_heads=16, num_key_value_heads=2,
                        max_position_embeddings=40960)


class Harness:
    """One model on the device with a KV pool and decode graphs."""

    def __init__(self, name: str, config: GptOssConfig, device, max_batch: int, max_ctx: int, headroom: float,
                 checkpoint: str | None = None, kv_cache_dtype: str = "auto", lm_head_dtype: str = "auto",
                 mxfp4_decode_max_tokens: int = 0, dense_dtype: str = "auto", decode_front: str = "auto",
                 moe_segments_max_rows: int | None = None):
        t0 = time.perf_counter()
        self.name, self.config, self.device = name, config, device
        # weights: the checkpoint folder when given (HF layout; MXFP4 / bf16 / FP8-converted experts),
        # else random of the real shapes, made on the device
        self.model = build_model(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                                 checkpoint=checkpoint, random_weights=checkpoint is None, max_batch=max_batch,
                                 max_kv_len=max_ctx + 2 * BLOCK, cuda_graph=device.type == "cuda",
                                 lm_head_dtype=lm_head_dtype, mxfp4_decode_max_tokens=mxfp4_decode_max_tokens,
                                 dense_dtype=dense_dtype, decode_front=decode_front,
                                 moe_segments_max_rows=moe_segments_max_rows)
        sync(device)
        self.build_s = time.perf_counter() - t0
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, self.model.dtype)
        self.shape = costs.ModelShape.of(self.model, name, torch.empty(0, dtype=self.kv_dtype).element_size())
        sliding = [config.is_sliding(i) for i in range(config.num_hidden_layers)]
        attn = self.model.model.layers[0].self_attn
        full_b = PagedKVCache.bytes_per_block(sum(not s for s in sliding), attn.num_kv_heads, attn.head_dim, BLOCK,
                                              self.kv_dtype)
        slide_b = PagedKVCache.bytes_per_block(sum(sliding), attn.num_kv_heads, attn.head_dim, BLOCK, self.kv_dtype)
        # Sliding pages: the live window of every decode row, and a whole prefill of max_ctx tokens.
        self.num_sliding = max(max_batch * (config.sliding_window // BLOCK + 2), max_ctx // BLOCK + 2)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = free - headroom * 2**30 - self.num_sliding * slide_b
        else:
            budget = 2**30
        self.num_full = max(1, int(budget // full_b))
        self.kv = PagedKVCache.allocate(sliding, self.num_full, self.num_sliding, BLOCK, attn.num_kv_heads,
                                        attn.head_dim, self.kv_dtype, device)
        gen = torch.Generator(device).manual_seed(1)
        for t in self.kv.k + self.kv.v:  # random K/V: the synthetic contexts read real-looking values
            if is_fp8(t.dtype):
                for page in range(0, t.shape[0], 4096):  # bounded scratch for the conversion
                    t[page:page + 4096] = torch.randn(t[page:page + 4096].shape, generator=gen, device=t.device)
            else:
                t.normal_(generator=gen)
        self.model.backend.bind_cache(self.kv)
        self.prefill_graphs = None  # engine/prefill_graphs.PrefillGraphs: prefill() replays it while set
        self.graphs = None
        self.capture = {}
        if device.type == "cuda":
            self.graphs = DecodeGraphs(self.model, default_buckets(max_batch))
            self.capture = self.graphs.capture()

    def release(self) -> None:
        """Drop the KV pool and the decode and prefill graphs (an engine run brings its own)."""
        self.graphs = None
        if self.prefill_graphs is not None:
            self.prefill_graphs.release()
        self.prefill_graphs = None
        self.model.backend.bind_cache(None)
        self.kv = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def max_batch_at(self, ctx: int) -> int:
        return self.num_full // math.ceil((ctx + 1) / BLOCK)

    # ---- batches --------------------------------------------------------------------------------
    def decode_batch(self, batch: int, ctx: int) -> AttentionBatch:
        """`batch` sequences that each hold `ctx` cached tokens and decode position ctx."""
        d, bs, w = self.device, BLOCK, self.config.sliding_window
        pages = math.ceil((ctx + 1) / bs)
        if batch * pages > self.num_full:  # page ids past the pool would read and write outside it
            raise ValueError(f"{batch} sequences of {ctx} tokens need {batch * pages} pages; the pool has "
                             f"{self.num_full} (max_batch_at({ctx}) = {self.max_batch_at(ctx)})")
        full = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
        first = max(0, ctx - (w - 1)) // bs  # first page still holding a position in the window
        live = ctx // bs - first + 1
        per_seq = w // bs + 2
        sliding = (torch.arange(batch, dtype=torch.int32)[:, None] * per_seq + torch.arange(live, dtype=torch.int32))
        full_slot = full[:, ctx // bs].long() * bs + ctx % bs
        slide_slot = sliding[:, -1].long() * bs + ctx % bs
        lens = [ctx + 1] * batch
        slens = [ctx + 1 - first * bs] * batch
        return AttentionBatch(
            torch.arange(batch + 1, dtype=torch.int32, device=d), [1] * batch,
            KVGroupMeta(full.to(d), torch.tensor(lens, dtype=torch.int32, device=d), full_slot.to(d), lens),
            KVGroupMeta(sliding.to(d), torch.tensor(slens, dtype=torch.int32, device=d), slide_slot.to(d), slens),
            is_decode=True)

    def prefill_batch(self, start: int, end: int) -> AttentionBatch:
        """Tokens start..end-1 of one sequence whose positions 0..start-1 are cached already (both
        layer kinds use pages 0.. of their pool; the sliding window masks what it must not see)."""
        d, bs = self.device, BLOCK
        pages = math.ceil(end / bs)
        table = torch.arange(pages, dtype=torch.int32, device=d)[None]
        slots = torch.arange(start, end, dtype=torch.int64, device=d)
        meta = KVGroupMeta(table, torch.tensor([end], dtype=torch.int32, device=d), slots, [end])
        meta_s = KVGroupMeta(table.clone(), meta.kv_lens.clone(), slots.clone(), [end])
        return AttentionBatch(torch.tensor([0, end - start], dtype=torch.int32, device=d), [end - start], meta, meta_s)

    def capture_prefill_graphs(self, buckets: list[int], pdl: bool = True) -> dict[int, float]:
        """Piecewise prefill graphs at these token buckets (engine/prefill_graphs.py), which prefill() then
        replays. Seconds per bucket."""
        from engine.prefill_graphs import PrefillGraphs

        self.prefill_graphs = PrefillGraphs(self.model, buckets, pdl=pdl)
        return self.prefill_graphs.capture()

    # ---- measurements ---------------------------------------------------------------------------
    def prefill_runner(self, tokens: int, chunk: int):
        """(run, number of chunks): run() is one prefill of `tokens` random ids in chunks of at most `chunk`
        (through the prefill graphs where they serve the chunk) and returns the last row's greedy token."""
        ids = torch.randint(0, self.config.vocab_size, (tokens,), device=self.device)
        pos = torch.arange(tokens, device=self.device)
        bounds = [(s, min(s + chunk, tokens)) for s in range(0, tokens, chunk)]
        batches = [self.prefill_batch(s, e) for s, e in bounds]

        pieces = self.prefill_graphs

        @torch.inference_mode()
        def run():  # chunked prefill, as the engine runs prompts longer than max_num_batched_tokens
            for (s, e), batch in zip(bounds, batches):
                if pieces is not None and pieces.serves(batch):
                    hidden = pieces.run(ids[s:e], pos[s:e], batch)
                else:
                    hidden = self.model(ids[s:e], pos[s:e], batch)
            return self.model.compute_logits(hidden[-1:]).float().argmax(-1)

        return run, len(bounds)

    @torch.inference_mode()
    def prefill(self, tokens: int, profile: bool, chunk: int) -> dict:
        run, chunks = self.prefill_runner(tokens, chunk)
        run()
        sync(self.device)
        s = timed(run, self.device)
        rested = timed_after_rest(run, self.device)
        floor = costs.prefill_floor_s(self.shape, tokens)
        point = {"tokens": tokens, "chunks": chunks, "ttft_ms": s * 1e3, "ttft_after_rest_ms": rested * 1e3, "usd_per_m_input": costs.dollars_per_million(tokens / s),
                 "input_tok_s": tokens / s, "roofline_fraction": floor / s, "floor_ms": floor * 1e3,
                 "flops": self.shape.prefill_flops(tokens)}
        if profile:
            point["top_kernels"] = top_kernels(run, self.device)
        return point

    @torch.inference_mode()
    def decode(self, batch: int, ctx: int, steps: int, profile: bool) -> dict:
        attn = self.decode_batch(batch, ctx)
        # the same ids for every call at this batch (MoE routing, so the experts read, follows them: A/B
        # variants in one process must see the same inputs)
        ids = torch.randint(0, self.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch)).to(self.device)
        pos = torch.full((batch,), ctx, dtype=torch.long, device=self.device)
        graphed = self.graphs is not None and self.graphs.bucket_for(batch) is not None
        state = {"ids": ids}

        def step():
            if graphed:
                logits = self.graphs.run(state["ids"], pos, attn)
            else:
                logits = self.model.compute_logits(self.model(state["ids"], pos, attn))
            state["ids"] = logits.argmax(-1)  # stays on the device: the next step's input

        def loop():
            for _ in range(steps):
                step()

        for _ in range(3):
            step()
        sync(self.device)
        s = timed(loop, self.device) / steps
        parts = self.shape.decode_bytes(batch, ctx)
        floor = sum(parts.values()) / costs.COPY_BYTES_PER_S
        point = {"batch": batch, "ctx": ctx, "step_ms": s * 1e3, "tok_s_user": 1 / s, "tok_s_gpu": batch / s,
                 "usd_per_m_output": costs.dollars_per_million(batch / s), "cuda_graph": graphed,
                 "bytes": parts, "floor_ms": floor * 1e3, "roofline_fraction": floor / s, "synthetic_kv": True}
        if profile:
            eager = (lambda: self.graphs.run_eager(state["ids"], pos, attn)) if graphed else step
            point["top_kernels_eager_step"] = top_kernels(eager, self.device)
        return point


def run_model(name: str, config: GptOssConfig, args, clock: Clock, results: dict, save) -> None:
    device = torch.device(args.device)
    # the throughput estimates decode at their own mean contexts (8,704 for 8k/1k): size for those too
    max_ctx = max(args.prefill_lens + args.contexts + [c for _, _, c in THROUGHPUT.values()]
                  + [i + o for i, o, _ in THROUGHPUT.values()])  # engine runs hold whole requests
    model_deadline = clock.left() * args.model_share  # build and capture count against it
    t_model = time.perf_counter()
    # the KV pool leaves the headroom asked, and never less than the engine's own estimate of its largest step
    # (engine/memory_budget.py; the prefill graphs of 8k-token chunks next to 512 decode rows: 120b ran out of a
    # fixed 4 GB at capture on 2026-12-04)
    headroom = max(args.headroom_gb, activation_bytes(config, args.prefill_chunk, args.max_batch) / 2**30)
    h = Harness(name, config, device, args.max_batch, max_ctx, headroom, args.checkpoint, args.kv_cache_dtype,
                args.lm_head_dtype, args.mxfp4_decode_max_tokens, args.dense_dtype, args.decode_front,
                args.moe_segments_max_rows)
    r = results["models"].setdefault(name, {"prefill": [], "decode": [], "throughput": []})
    r.update(build_s=h.build_s, capture_s=h.capture, capture_s_total=sum(h.capture.values()),
             weight_bytes={"experts": h.shape.expert_bytes * config.num_local_experts * config.num_hidden_layers,
                           "dense_per_layer": h.shape.dense_bytes_per_layer, "embed": h.shape.embed_bytes},
             kv_pool={"full_pages": h.num_full, "sliding_pages": h.num_sliding, "block": BLOCK},
             moe_segments_max_rows=segments_max_rows_of(h.model))
    if args.prefill_graphs and device.type == "cuda":  # the prefill points through engine/prefill_graphs.py: a bucket per chunk length
        chunk = args.prefill_chunk
        r["prefill_graph_capture_s"] = h.capture_prefill_graphs(
            sorted({min(chunk, n - s) for n in args.prefill_lens for s in range(0, n, chunk)}))
    save()
    contexts = args.contexts
    batches = [b for b in default_buckets(args.max_batch) if b & (b - 1) == 0 or b == args.max_batch]  # the table's
    plan = [("decode", 1, contexts[0]), ("prefill", 8192 if 8192 in args.prefill_lens else args.prefill_lens[-1]),
            ("prefill", 4096 if 4096 in args.prefill_lens else args.prefill_lens[0])]
    plan += [("decode", b, contexts[0]) for b in batches[1:]]
    plan += [("prefill", n) for n in args.prefill_lens]
    plan += [("decode", b, c) for c in contexts[1:] for b in batches]
    plan += [("throughput", k) for k in THROUGHPUT]
    plan.append(("decode", 1, 1024))  # the HF baseline's decode point (bench/e2e_hf.py)
    # Profiles last: CUPTI next to CUDA graphs is the riskiest part of the run.
    plan += [("profile", "decode", 1, contexts[0]), ("profile", "decode", 64, contexts[0]),
             ("profile", "prefill", 8192, args.prefill_chunk), ("profile", "prefill", 1024, args.prefill_chunk)]
    if not args.table:  # what the engine runs need: the prefill rate and each scenario's estimate (its batch)
        plan = [("prefill", n) for n in args.prefill_lens] + [
            ("throughput", k) for k in THROUGHPUT if k in args.engine_runs.split(",")]
    done: set = set()
    for item in plan:
        if item in done:
            continue
        done.add(item)
        if clock.left() < 5 or time.perf_counter() - t_model > model_deadline:
            r["stopped_by_time_guard"] = True
            print(f"[{name}] time guard: skipping {item} and the rest", flush=True)
            break
        try:
            if item[0] == "prefill":
                point = h.prefill(item[1], profile=False, chunk=args.prefill_chunk)
                r["prefill"].append(point)
                print(f"[{name}] prefill {item[1]}: {point['ttft_ms']:.2f} ms back to back, "
                      f"{point['ttft_after_rest_ms']:.2f} ms after a rest", flush=True)
            elif item[0] == "decode":
                _, b, c = item
                if b > h.max_batch_at(c):
                    r["decode"].append({"batch": b, "ctx": c, "skipped": f"KV pool holds {h.max_batch_at(c)} "
                                        f"sequences of {c} tokens"})
                    continue
                point = h.decode(b, c, args.steps, profile=False)
                r["decode"].append(point)
                print(f"[{name}] decode b={b} ctx={c}: {point['step_ms']:.3f} ms/step "
                      f"{point['tok_s_user']:.1f} tok/s/user {point['tok_s_gpu']:.0f} tok/s/GPU", flush=True)
            elif item[0] == "throughput":
                r["throughput"].append(throughput_point(h, item[1], r, args))
            else:
                attach_profile(h, item[1:], r)
        except torch.OutOfMemoryError as e:
            r.setdefault("errors", []).append(f"{item}: out of memory ({str(e)[:120]})")
            torch.cuda.empty_cache()
        except RuntimeError as e:  # a failing point (kernel, profiler) must not lose the others
            r.setdefault("errors", []).append(f"{item}: {type(e).__name__}: {str(e)[:300]}")
            print(f"[{name}] {item} failed: {e}", flush=True)
        save()
    if device.type == "cuda":  # what the headroom has to hold: the peak beyond weights and KV pool
        free, total = torch.cuda.mem_get_info(device)
        r["memory_gb"] = {"total": total / 2**30, "free_now": free / 2**30,
                          "peak_allocated": torch.cuda.max_memory_allocated(device) / 2**30,
                          "headroom_asked": args.headroom_gb, "headroom_used": headroom}
    if args.engine_runs and clock.left() > 60 and time.perf_counter() - t_model < model_deadline:
        engine_runs(h, r, args, clock, save, THROUGHPUT)
    save()
    del h
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def attach_profile(h: Harness, what: tuple, r: dict) -> None:
    """Top kernels of one measured point, stored in that point's record."""
    if what[0] == "decode":
        points = [d for d in r["decode"] if d.get("batch") == what[1] and d.get("ctx") == what[2] and "step_ms" in d]
        if points:
            points[0]["top_kernels_eager_step"] = h.decode(what[1], what[2], 1, profile=True)["top_kernels_eager_step"]
    else:
        points = [p for p in r["prefill"] if p["tokens"] == what[1]]
        if points:
            points[0]["top_kernels"] = h.prefill(what[1], profile=True, chunk=what[2])["top_kernels"]


def throughput_point(h: Harness, scenario: str, r: dict, args) -> dict:
    in_len, out_len, ctx = THROUGHPUT[scenario]
    prefill = [p for p in r["prefill"] if "ttft_ms" in p]
    if not prefill:
        raise RuntimeError("throughput estimates need a measured prefill point")
    # The prompts of a batch prefill as long chunks: use the best measured prefill rate up to 16k tokens.
    rate = max(p["input_tok_s"] for p in prefill if p["tokens"] <= 16384)
    # each request holds at most in_len + out_len tokens (ctx is the mean decode context, not the last)
    fits = max(1, min(args.max_batch, h.max_batch_at(in_len + out_len)))
    batch = max(b for b in default_buckets(args.max_batch) if b <= fits)  # a captured bucket
    step = h.decode(batch, ctx, args.steps, profile=False)
    est = costs.estimate_throughput(1 / rate, step["step_ms"] / 1e3, batch, out_len, in_len)
    est.update(scenario=scenario, decode_ctx=ctx, step_ms=step["step_ms"], prefill_tok_s=rate,
               method="estimated: measured decode step at the mean context x out_len + batch prompts at the "
                      "measured prefill rate (no full run)")
    print(f"[{h.name}] throughput {scenario}: {est['output_tok_s']:.0f} output tok/s/GPU (batch {batch})", flush=True)
    return est


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny random model (CPU smoke run)")
    p.add_argument("--checkpoint", help="a checkpoint folder (HF layout) to load instead of random weights; "
                                        "the model is named after the folder")
    p.add_argument("--models", default="gpt-oss-20b,gpt-oss-120b")
    p.add_argument("--prefill-lens", default=",".join(map(str, PREFILL_LENS)))
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=10, help="decode steps per timed loop")
    p.add_argument("--budget-s", type=float, default=400.0)
    p.add_argument("--model-share", type=float, default=0.5, help="fraction of the remaining time one model may use")
    p.add_argument("--headroom-gb", type=float, default=10.0, help="GPU memory kept free of the KV pool")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="K/V storage: auto = the model dtype (bf16); fp8_e4m3 halves KV memory and bytes")
    p.add_argument("--lm-head-dtype", default="auto", choices=("auto", "fp8_e4m3"),
                   help="unembedding weights: the model's dtype, or FP8 128x128 blocks (weight-only; opt-in, not exact)")
    p.add_argument("--dense-dtype", default="auto", choices=("auto", "fp8_e4m3"),
                   help="QKV / O weights: the model's dtype, or FP8 128x128 blocks with FP8 activations in steps "
                        "above 64 tokens (EngineConfig.dense_dtype; opt-in, not exact)")
    p.add_argument("--decode-front", default="auto", choices=("auto", "triton", "cuda"),
                   help="MoE front of single-token decode steps (EngineConfig.decode_front; auto: the CUDA cluster "
                        "front for routers of >= 128 experts)")
    p.add_argument("--moe-segments-max-rows", type=int, default=None, metavar="R",
                   help="steps of > 64 tokens with at most R rows per expert on the segments GEMM "
                        "(EngineConfig.moe_segments_max_rows; default: the kernel's, 16; 0: DeepGEMM)")
    p.add_argument("--mxfp4-decode-max-tokens", type=int, default=0, metavar="T",
                   help="random weights drawn as MXFP4 (FP8 converted from them) and decode steps of <= T tokens on the "
                        "CUDA MXFP4 GEMM (EngineConfig.mxfp4_decode_max_tokens); 0: FP8 experts only")
    p.add_argument("--prefill-chunk", type=int, default=8192, help="longest prefill forward (longer prompts chunk)")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill points as piecewise CUDA graphs (engine/prefill_graphs.py), as the engine runs them")
    p.add_argument("--engine-runs", default="", help="scenarios (1k/1k,8k/1k) to also run through LLMEngine "
                                                      "at the estimate's batch, b1 (one request alone) and b1sync "
                                                      "(the same, decode lookahead off; bench/e2e_engine_runs.py)")
    p.add_argument("--table", action=argparse.BooleanOptionalAction, default=True,
                   help="the decode / prefill table and profiles; --no-table: only the prefill lengths and the "
                        "estimates the --engine-runs scenarios need, then those runs (A/B of an engine setting)")
    p.add_argument("--hf-baseline", action="store_true", help="then HF transformers bf16 on 20b (random weights)")
    p.add_argument("--out", default="bench/results/e2e.json")
    args = p.parse_args(argv)
    args.prefill_lens = [int(x) for x in args.prefill_lens.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    clock = Clock(args.budget_s)
    device = torch.device(args.device)
    results = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": _device_name(device),
               "torch": torch.__version__, "args": {k: v for k, v in vars(args).items()},
               "notes": [f"weights from {args.checkpoint}" if args.checkpoint else
                         "random weights of the real shapes (no checkpoint download possible)",
                         "decode contexts are synthetic: random K/V pages + set lengths, no 32k prefill",
                         "throughput 1k/1k and 8k/1k: estimates from measured prefill/decode points; "
                         "engine_runs (when asked): the same batches through LLMEngine, measured",
                         f"cost at ${costs.DOLLARS_PER_GPU_HOUR:.2f} per GPU-hour"],
               "models": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(results, indent=1, default=str))

    if args.checkpoint:
        from model.loader import read_config

        checkpoint_config = read_config(args.checkpoint)
        names = [Path(args.checkpoint).resolve().name]
    else:
        names = ["tiny"] if args.tiny else args.models.split(",")
    for i, name in enumerate(names):
        config = checkpoint_config if args.checkpoint else tiny_config() if args.tiny else GptOssConfig.preset(name)
        share = args.model_share
        args.model_share = 1.0 if i == len(names) - 1 and not args.hf_baseline else share
        run_model(name, config, args, clock, results, save)
        args.model_share = share
    if args.hf_baseline and clock.left() > 30:
        from bench.e2e_hf import hf_baseline

        results["hf_baseline"] = hf_baseline(device, clock.left() - 10, tiny=args.tiny)
        save()
    if device.type == "cuda" or args.tiny:
        results["plots"] = costs.plot(results, out.parent, out.stem)
    save()
    costs.print_table(results)
    print(f"\nwrote {out}")
    return 0


def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    raise SystemExit(main())
