"""Engine throughput of variants in one process: one engine (random weights of the real shapes), the same
requests, variants alternated over `--rounds` rounds.

    python -m bench.engine_ab --model gpt-oss-20b --requests 256 --in-len 1024 --out-len 256 \\
        --variants graphs --out bench/results/engine_ab_graphs_h200.json

Variant sets:
- `sliding`: the sliding-window layers through FlashInfer's windowed sink prefill, with a mixed step's
  one-token rows gathered through the split decode kernel (the backend before
  kernels/attention/sliding_prefill_triton.py), against the Triton sliding kernel over every sequence of
  the step in place (two launches per sliding layer, no gathers). Such a workload is mostly mixed steps
  (prompt chunks next to hundreds of decoding rows): launches per step count.
  bench/results/engine_ab_sliding_20b_h200.json predates the warm-up: its round 0 is the warm-up.
- `graphs`: prefill and mixed steps eager against the piecewise prefill graphs (engine/prefill_graphs.py),
  decode steps in their graphs either way.
Reported: output tokens/s per round and variant (after an untimed warm-up of 32 requests per variant),
the median, and with `--ttft-lens` the time to first token of one request alone (median of 5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerateRequest, SamplingParams
from model.config import GptOssConfig

def _sliding(kind: str):
    def apply(engine: LLMEngine) -> None:
        engine.model.backend.sliding_prefill = kind
    return apply


def _prefill_graphs(on: bool):
    def apply(engine: LLMEngine) -> None:
        runner = engine.runner
        if not hasattr(runner, "captured_prefill_graphs"):
            runner.captured_prefill_graphs = runner.prefill_graphs
        runner.prefill_graphs = runner.captured_prefill_graphs if on else None
    return apply


VARIANTS = {"sliding": {"flashinfer sliding": _sliding("flashinfer"), "triton sliding in place": _sliding("triton")},
            "graphs": {"eager prefill": _prefill_graphs(False), "prefill graphs": _prefill_graphs(True)}}


def ttft_ms(engine: LLMEngine, prompt: list[int], tag: str) -> float:
    """Wall time of one request alone to its first token (prefill + sampling + the host's step work)."""
    times = []
    for i in range(6):
        t0 = time.perf_counter()
        engine.generate([GenerateRequest(f"ttft-{tag}-{i}", prompt, SamplingParams(max_tokens=1))])
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--variants", choices=sorted(VARIANTS), default="sliding")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--in-len", type=int, default=1024)
    p.add_argument("--out-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--kv-cache-gib", type=float, default=40.0)
    p.add_argument("--ttft-lens", default="", help="prompt lengths whose one-request TTFT to time per variant")
    p.add_argument("--out", default="bench/results/engine_ab.json")
    args = p.parse_args(argv)
    ttft_lens = [int(x) for x in args.ttft_lens.split(",") if x]
    graphs = args.variants == "graphs"
    config = EngineConfig(device="cuda", max_num_seqs=args.requests, max_num_batched_tokens=args.chunk,
                          max_model_len=max([args.in_len + args.out_len] + [n + 1 for n in ttft_lens]),
                          kv_cache_bytes=int(args.kv_cache_gib * 2**30), cuda_graphs=graphs, prefill_graphs=graphs,
                          enable_prefix_caching=False)  # rounds repeat the prompts: no cache hits across them
    shapes = GptOssConfig.preset(args.model)
    t0 = time.perf_counter()
    engine = LLMEngine.with_random_weights(shapes, config)
    setup = {"build_and_capture_s": time.perf_counter() - t0,
             "prefill_graph_capture_s": sum(engine.prefill_graph_capture_seconds.values()),
             "decode_graph_capture_s": sum(engine.graph_capture_seconds.values())}
    print(f"engine ready: {setup}", flush=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, shapes.vocab_size, (args.in_len,), generator=g).tolist() for _ in range(args.requests)]
    variants = VARIANTS[args.variants]
    runs = {name: [] for name in variants}
    tokens = {}
    for name, apply in variants.items():  # warm-up, not timed: JIT, first launches, allocator
        apply(engine)
        engine.generate([GenerateRequest(f"warm-{name}-{i}", p, SamplingParams(max_tokens=8, ignore_eos=True))
                         for i, p in enumerate(prompts[:32])])
    ttft = {}
    for n in ttft_lens:
        prompt = torch.randint(0, shapes.vocab_size, (n,), generator=g).tolist()
        for name, apply in variants.items():
            apply(engine)
            ttft.setdefault(name, {})[n] = ttft_ms(engine, prompt, f"{name}-{n}")
        print(f"TTFT {n} tokens: " + "; ".join(f"{name} {v[n]:.2f} ms" for name, v in ttft.items()), flush=True)
    for r in range(args.rounds):
        for name, apply in variants.items():
            apply(engine)
            reqs = [GenerateRequest(f"{name}-{r}-{i}", p, SamplingParams(temperature=0.0, max_tokens=args.out_len,
                                                                         ignore_eos=True)) for i, p in enumerate(prompts)]
            t0 = time.perf_counter()
            outs = engine.generate(reqs)
            wall = time.perf_counter() - t0
            runs[name].append(sum(len(o.output_ids) for o in outs) / wall)
            tokens[name] = [o.output_ids[:8] for o in outs[:4]]
            print(f"round {r} {name}: {runs[name][-1]:.0f} output tok/s ({wall:.1f} s)", flush=True)
    engine.close()
    summary = {name: statistics.median(v) for name, v in runs.items()}
    for name, v in summary.items():
        print(f"{name:>26}: {v:8.0f} output tok/s (median of {len(runs[name])})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "device": torch.cuda.get_device_name(), "args": vars(args), "runs": runs,
                                          "median_tok_s": summary, "first_tokens": tokens, "ttft_ms": ttft,
                                          "setup": setup}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
