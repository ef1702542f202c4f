"""Speculative decoding from predicted outputs and prompt lookup (engine/speculative.py): tokens per second
through the engine, against plain decoding in the same process.

    python -m bench.speculative                                   # CPU, the tiny model (smoke; a minute)
    python -m bench.speculative --device cuda --model gpt-oss-20b # one GPU, random weights of the real shapes

Each request: a random prompt of --prompt-len tokens, --out-len tokens greedy with ignore_eos. The plain run
(no prediction: the engine's lookahead as configured) gives the output O. Then the same request with
`prediction` =
- O itself at draft length 4. In exact arithmetic every draft is accepted and the output is O again; in
  bf16 on the GPU a verify step computes its rows in another batch shape than one-row decoding (other GEMM
  tiles, split-K and attention splits), so logits differ in the last bits and random weights, whose top two
  logits are often within that noise, flip a greedy pick now and then (tests/engine/test_e2e_gpu.py checks
  that divergences only happen at such near-ties). The row says how far O's prediction carries;
- a self-consistent O at draft lengths 2, 4, 8: the output of the previous round with prediction fed back
  until the output reproduces its prediction (at most ROUNDS rounds): every draft accepted, the upper bound of
  what a verify step of k + 1 rows yields;
- an edited O (one token in ten replaced, three inserted, three deleted: an edit of a file), a wrong
  prediction (random tokens), and prompt lookup alone (`speculative_ngram`: drafts from the request's own
  tokens; random weights loop or not, so its rate here says nothing about real text).
The same at 4 concurrent requests. "same": the output equals O. Random weights make acceptance a property
of the prediction given, not of the model: read the self-consistent rows as what a verify step costs and
yields, not as a rate to expect on real text. Host time per step (schedule / prepare / update, from the
engine's metrics) shows what speculation pays for giving up the lookahead.

The draft length is EngineConfig.speculative_tokens; this benchmark sets it on the running engine between
requests (the scheduler reads it per step), so every variant shares one engine and its CUDA graphs.

JSON and a PNG under bench/results/ (speculative_<device>.{json,png}); a table printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerateRequest, SamplingParams

CONCURRENT = 4
ROUNDS = 12


def edit(tokens: list[int], vocab: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    out = list(tokens)
    for i in range(5, len(out), 10):
        out[i] = int(rng.integers(0, vocab))
    mid = len(out) // 2
    return out[:mid] + [int(t) for t in rng.integers(0, vocab, 3)] + out[mid + 3:]


def run(engine: LLMEngine, prompts: list[list[int]], out_len: int, predictions: list[tuple] | None, k: int,
        ngram: bool, tag: str) -> dict:
    engine.config.speculative_tokens, engine.config.speculative_ngram = k, ngram
    snap0, times0 = engine.metrics.snapshot(), dataclasses.replace(engine.metrics.step_seconds)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        engine.add_request(GenerateRequest(rid, prompt, SamplingParams(
            temperature=0.0, max_tokens=out_len, ignore_eos=True, prediction=predictions[i] if predictions else ())))
    outs = {rid: [] for rid in ids}
    stamps, steps = [], 0
    while engine.has_unfinished():
        deltas = engine.step()
        now = time.perf_counter()
        steps += 1
        for d in deltas:
            outs[d.request_id] += d.token_ids
        stamps.append((now, sum(len(d.token_ids) for d in deltas)))
    snap, times = engine.metrics.snapshot(), engine.metrics.step_seconds
    nsteps = max(1, snap["steps_total"] - snap0["steps_total"])
    host = {f"{name}_us": 1e6 * (getattr(times, name) - getattr(times0, name)) / nsteps
            for name in ("schedule", "prepare", "forward", "update")}
    # from the step that delivered the first tokens (the prefill's) to the last: decode only
    first = next(i for i, (_, n) in enumerate(stamps) if n)
    span = stamps[-1][0] - stamps[first][0]
    tokens = sum(n for _, n in stamps[first + 1:])
    return {"outputs": [outs[r] for r in ids], "decode_s": span, "decode_tokens": tokens,
            "tok_s": tokens / span, "decode_steps": len(stamps) - first - 1,
            "ms_per_step": 1e3 * span / max(1, len(stamps) - first - 1),
            "drafted": snap["draft_tokens_total"] - snap0["draft_tokens_total"],
            "accepted": snap["draft_accepted_total"] - snap0["draft_accepted_total"], **host}


def first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    """The first output index where any request's tokens differ (None: all equal)."""
    diffs = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(a, b)]
    return min((d for d in diffs if d is not None), default=None)


def self_consistent(engine, prompts, out_len, first: list[list[int]], k: int, tag: str) -> tuple[dict, int, bool]:
    """Feed each round's output back as the next round's prediction until it reproduces its prediction."""
    preds = first
    for rnd in range(1, ROUNDS + 1):
        r = run(engine, prompts, out_len, [tuple(p) for p in preds], k, False, f"{tag}-r{rnd}")
        if r["outputs"] == preds:
            return r, rnd, True
        preds = r["outputs"]
    return r, ROUNDS, False


def bench(engine: LLMEngine, prompt_len: int, out_len: int) -> list[dict]:
    vocab = min(engine.vocab_size, 199998)  # ordinary tokens only
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(CONCURRENT)]
    rows = []
    for batch in (1, CONCURRENT):
        ps = prompts[:batch]
        run(engine, ps, min(out_len, 32), None, 0, False, f"warm{batch}")  # graphs, allocator, first steps
        plain = run(engine, ps, out_len, None, 0, False, f"plain{batch}")
        wrong = [tuple(torch.randint(0, vocab, (out_len,), generator=gen).tolist()) for _ in ps]
        variants = [("plain", None, 0, False), ("plain output as prediction, k=4", plain["outputs"], 4, False)]
        variants += [(f"self-consistent prediction, k={k}", plain["outputs"], k, None) for k in (2, 4, 8)]
        variants += [("edited prediction, k=4", [edit(o, vocab, i) for i, o in enumerate(plain["outputs"])], 4, False),
                     ("wrong prediction, k=4", wrong, 4, False),
                     ("prompt lookup, k=4", None, 4, True)]
        for name, preds, k, ngram in variants:
            rounds = converged = None
            if name == "plain":
                r = plain
            elif ngram is None:
                r, rounds, converged = self_consistent(engine, ps, out_len, preds, k, f"{name}{batch}")
            else:
                r = run(engine, ps, out_len, [tuple(p) for p in preds] if preds else None, k, ngram, f"{name}{batch}")
            row = {"batch": batch, "variant": name, "same": r["outputs"] == plain["outputs"],
                   "first_difference": first_difference(r["outputs"], plain["outputs"]), "rounds": rounds,
                   "converged": converged, **{key: v for key, v in r.items() if key != "outputs"}}
            row["vs_plain"] = row["tok_s"] / plain["tok_s"]
            row["tokens_per_step"] = row["decode_tokens"] / max(1, row["decode_steps"]) / batch
            row["acceptance"] = row["accepted"] / row["drafted"] if row["drafted"] else None
            rows.append(row)
            print(f"b{batch} {name}: {row['tok_s']:.0f} tok/s ({row['vs_plain']:.2f}x), {row['ms_per_step']:.3f} ms "
                  f"per step, {row['tokens_per_step']:.2f} tokens per step per request, same {row['same']} (first "
                  f"difference {row['first_difference']}), rounds {rounds} converged {converged}, host us per step "
                  f"schedule {row['schedule_us']:.0f} prepare {row['prepare_us']:.0f} forward+wait "
                  f"{row['forward_us']:.0f} update {row['update_us']:.0f}", flush=True)
    return rows


def build_engine(args) -> LLMEngine:
    from model.tiny import shapes_by_name

    model_config = shapes_by_name(args.model)
    cuda = args.device == "cuda"
    # 48 seats: 4 requests x (1 + 8 drafts) rows fit the largest decode graph (drafts never exceed the seats)
    config = EngineConfig(device=args.device, max_num_seqs=48, max_num_batched_tokens=4096,
                          max_model_len=args.prompt_len + args.out_len + 16, speculative_max_seqs=CONCURRENT,
                          kv_cache_bytes=(8 << 30) if cuda else (256 << 20), cuda_graphs=cuda,
                          kv_cache_dtype=args.kv_cache_dtype)
    return LLMEngine.with_random_weights(model_config, config)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches):
        rows = [r for r in result["rows"] if r["batch"] == b]
        ax.barh([r["variant"] for r in rows][::-1], [r["tok_s"] / b for r in rows][::-1])
        ax.set_xlabel("output tokens/s per request")
        ax.set_title(f"{result['model']}, {b} request(s), {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="tiny", help="tiny, gpt-oss-20b or gpt-oss-120b (random weights)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--out-len", type=int, default=256)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = Path(args.out or f"bench/results/speculative_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    t0 = time.perf_counter()
    engine = build_engine(args)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device,
              "model": args.model, "args": vars(args), "build_s": time.perf_counter() - t0,
              "async_decode": engine.async_decode}
    result["rows"] = bench(engine, args.prompt_len, args.out_len)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"\n{args.model} on {device}: prompt {args.prompt_len}, {args.out_len} tokens greedy (wrote {out})")
    print(f"{'batch':>5} {'variant':<34} {'tok/s/req':>9} {'vs plain':>8} {'ms/step':>8} {'tok/step':>8} "
          f"{'accept':>6} {'host us':>7} first diff")
    for r in result["rows"]:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        host = r["schedule_us"] + r["prepare_us"] + r["update_us"]
        print(f"{r['batch']:>5} {r['variant']:<34} {r['tok_s'] / r['batch']:>9.1f} {r['vs_plain']:>8.2f} "
              f"{r['ms_per_step']:>8.3f} {r['tokens_per_step']:>8.2f} {acc:>6} {host:>7.0f} {r['first_difference']}")


if __name__ == "__main__":
    main()
