"""What a new engine's first user requests wait for, with and without engine/warm_up.py: time to first token
of the same traffic run twice (round 0 = the first traffic the engine sees, round 1 = the same again), each
variant in a fresh process.

Kernel caches: a first process ("capture") builds the engine over empty Triton and DeepGEMM caches, as a new
replica on a new node, and reports how long that took (graph capture compiles every kernel the graphs run).
Each variant then starts from a copy of what it left, so round 0 shows what the graphs did not compile: what
the warm-up exists for.

    python -m bench.warm_up_probe --model gpt-oss-20b --out bench/results/warm_up_probe_h200.json   (GPU)
    python -m bench.warm_up_probe --tiny --device cpu                                                 (smoke run)

Traffic (random prompt ids, `--max-tokens` tokens each): a 1,024-token greedy prompt; a 1,000-token prompt
sampled with temperature, top-p and logprobs; the first prompt plus 100 tokens (a prefix-cache hit); a burst of
four prompts of 300, 517, 64 and 777 tokens (chunks beside decoding rows); a 600-token prompt sampled with top-k
and a frequency penalty. Per request: TTFT and ms per output
token. Round 1 is what a warm engine does; the table prints round 0 / round 1 per variant. Random weights of the
real shapes (no checkpoint here); nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.child_run import run_child

TRAFFIC = (("greedy-1024", (1024,), "greedy"), ("sampled-1000", (1000,), "sampled"),
           ("prefix-hit-1124", (1024, 100), "greedy"), ("burst-4", (300, 517, 64, 777), "greedy"),
           ("top-k-penalized-600", (600,), "top-k"))


def _requests(name: str, lens: tuple, kind: str, vocab: int, max_tokens: int, round_: int, scale: float):
    import torch

    from engine.request import GenerateRequest, SamplingParams

    # the same ids in both variants; other ids in each round (a round's prompts must not hit the last one's pages)
    g = torch.Generator().manual_seed(1000 * round_ + sum(map(ord, name)))
    lens = tuple(max(1, int(n * scale)) for n in lens)
    if name.startswith("prefix-hit"):  # this round's greedy prompt, then its own tokens
        g0 = torch.Generator().manual_seed(1000 * round_ + sum(map(ord, "greedy-1024")))
        base = torch.randint(0, vocab, (lens[0],), generator=g0).tolist()
        prompts = [base + torch.randint(0, vocab, (lens[1],), generator=g).tolist()]
    else:
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    params = {"greedy": SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
              "sampled": SamplingParams(temperature=0.8, top_p=0.9, logprobs=2, seed=3, max_tokens=max_tokens,
                                        ignore_eos=True),
              "top-k": SamplingParams(temperature=1.0, top_k=40, frequency_penalty=0.5, seed=4, max_tokens=max_tokens,
                                      ignore_eos=True)}[kind]
    return [GenerateRequest(f"{name}-{i}-r{round_}", p, params) for i, p in enumerate(prompts)]


def _run(engine, requests) -> dict:
    start = time.perf_counter()
    for r in requests:
        engine.add_request(r)
    first, last, count = {}, {}, {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.token_ids:
                now = time.perf_counter() - start
                first.setdefault(d.request_id, now)
                last[d.request_id] = now
                count[d.request_id] = count.get(d.request_id, 0) + len(d.token_ids)
    tpot = [(last[r] - first[r]) / max(1, count[r] - 1) for r in first]
    return {"ttft_ms": 1e3 * max(first.values()), "tpot_ms": 1e3 * sum(tpot) / len(tpot)}


def _compiled_kernels() -> set[str]:
    """Triton's cache entries as `kernel name/hash` (each compiled kernel leaves a NAME.json in its hash folder)."""
    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return {f"{p.stem}/{p.parent.name[:8]}" for p in root.glob("*/*.json") if not p.name.startswith("__grp__")}


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def child(args) -> None:
    """One fresh engine: build (graph capture included), optionally warm up, then the traffic twice; the record
    is rewritten into --child-out after every phase, so a timeout keeps what was measured."""
    from bench.e2e import tiny_config
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.warm_up import warm_up
    from model.config import GptOssConfig

    faulthandler.dump_traceback_later(args.dump_after_s)  # where a child that runs into its timeout is
    out = Path(args.child_out)
    record: dict = {"variant": args.variant, "compiled": {}}
    save = lambda: out.write_text(json.dumps(record))  # noqa: E731
    seen = _compiled_kernels()

    def compiled(phase: str) -> None:  # the Triton kernels this phase compiled (new entries in the cache)
        nonlocal seen
        now = _compiled_kernels()
        record["compiled"][phase] = sorted(now - seen)
        seen = now
    cuda = args.device.startswith("cuda")
    shapes = tiny_config() if args.tiny else GptOssConfig.preset(args.model)
    scale = 0.125 if args.tiny else 1.0
    config = EngineConfig(device=args.device, dtype="bfloat16" if cuda else "float32", max_num_seqs=8,
                          max_num_batched_tokens=2048, max_model_len=4096, kv_cache_bytes=args.kv_cache_mb * 2**20,
                          cuda_graphs=cuda)
    _say(f"{args.variant}: building the engine")
    t0 = time.perf_counter()
    engine = LLMEngine.with_random_weights(shapes, config, seed=0)
    record.update(build_s=time.perf_counter() - t0, graph_capture_s=engine.graph_capture_seconds,
                  prefill_graph_capture_s=engine.prefill_graph_capture_seconds)
    compiled("build")
    save()
    _say(f"{args.variant}: built in {record['build_s']:.1f} s (decode graphs "
         f"{sum(engine.graph_capture_seconds.values()):.1f} s, prefill graphs "
         f"{sum(engine.prefill_graph_capture_seconds.values()):.1f} s)")
    if args.variant == "capture":
        engine.close()
        return
    if args.variant == "warm-up":
        report = warm_up(engine)
        record["warm_up"] = {k: report[k] for k in ("seconds", "steps", "steps_by_path")}
        compiled("warm_up")
        save()
        _say(f"{args.variant}: warm-up {report['seconds']:.2f} s, {report['steps']} steps")
    record["rounds"] = []
    for round_ in range(2):
        record["rounds"].append({})
        for name, lens, kind in TRAFFIC:
            record["rounds"][-1][name] = _run(engine, _requests(name, lens, kind, shapes.vocab_size, args.max_tokens,
                                                                round_, scale))
            compiled(f"round{round_}:{name}")
            save()
        _say(f"{args.variant}: round {round_} " + ", ".join(f"{n} {v['ttft_ms']:.1f} ms"
                                                           for n, v in record["rounds"][-1].items()))
    engine.close()


def _child_run(variant: str, cache: str, args, timeout: float) -> dict:
    """`variant` in a fresh process over the kernel caches under `cache`; its record, partial on a timeout."""
    env = dict(os.environ, TRITON_CACHE_DIR=f"{cache}/triton", DG_JIT_CACHE_DIR=f"{cache}/deep_gemm")
    out = f"{cache}.{variant}.json"
    cmd = [sys.executable, "-m", "bench.warm_up_probe", "--variant", variant, "--child-out", out,
           "--model", args.model, "--device", args.device, "--max-tokens", str(args.max_tokens),
           "--kv-cache-mb", str(args.kv_cache_mb), "--dump-after-s", str(max(1.0, timeout - 10))] + \
        (["--tiny"] if args.tiny else [])
    return run_child(cmd, env, out, timeout, {"variant": variant})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, prompts / 8 (CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default="cold,warm-up", help="cold: no warm-up; warm-up: engine/warm_up.py first")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-cache-mb", type=int, default=16384)
    p.add_argument("--capture-timeout-s", type=float, default=330, help="the first, cold-cache build")
    p.add_argument("--variant-timeout-s", type=float, default=120)
    p.add_argument("--cache-out", help="also pack the capture's Triton cache into this .txz")
    p.add_argument("--out", default="bench/results/warm_up_probe.json")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # set in the child processes
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--dump-after-s", type=float, default=3600, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.kv_cache_mb = min(args.kv_cache_mb, 64)
    if args.variant:  # a child: one variant, its record into --child-out
        child(args)
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": "tiny" if args.tiny else args.model,
              "device": args.device, "args": vars(args), "records": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = f"{tmp}/base"
        os.makedirs(f"{base}/triton")
        record["records"].append(_child_run("capture", base, args, args.capture_timeout_s))
        out.write_text(json.dumps(record, indent=1))
        if args.cache_out:
            subprocess.run(["tar", "cJf", args.cache_out, "-C", base, "triton"], check=False)
        for i, variant in enumerate(args.variants.split(",")):  # a variant may repeat (cold,warm-up,cold,warm-up)
            shutil.copytree(base, f"{tmp}/{i}")  # each variant starts from what the capture compiled
            record["records"].append(_child_run(variant, f"{tmp}/{i}", args, args.variant_timeout_s))
            out.write_text(json.dumps(record, indent=1))
    print_table(record)
    for r in record["records"]:
        for phase, names in r.get("compiled", {}).items():
            if names and phase != "build":
                print(f"{r['variant']}: {phase} compiled {len(names)}: {', '.join(n.split('/')[0] for n in names)}")
    print(f"wrote {out}")
    return 0


def print_table(record: dict) -> None:
    print(f"{'variant':>8s} {'exit':>7s} {'build s':>8s} {'warm-up s':>9s}  " +
          "  ".join(f"{name + ' TTFT ms r0/r1':>28s}" for name, _, _ in TRAFFIC))
    for r in record["records"]:
        rounds = r.get("rounds", [])
        cells = [" / ".join(f"{rd[n]['ttft_ms']:.1f}" if n in rd else "-" for rd in rounds) or "-" for n, _, _ in TRAFFIC]
        warm = r.get("warm_up", {}).get("seconds")
        build = f"{r['build_s']:8.2f}" if "build_s" in r else f"{'-':>8s}"
        print(f"{r['variant']:>8s} {str(r['exit']):>7s} {build} {warm if warm is not None else float('nan'):9.2f}  " +
              "  ".join(f"{c:>28s}" for c in cells))


if __name__ == "__main__":
    raise SystemExit(main())
