"""Speculative decoding from predicted outputs and prompt lookup (engine/speculative.py): tokens per second
through the engine, against plain decoding in the same process.

    python -m bench.speculative                                   # CPU, the tiny model (smoke; a minute)
    python -m bench.speculative --device cuda --model gpt-oss-20b # one GPU, random weights of the real shapes

Each request: a random prompt of --prompt-len tokens, --out-len tokens greedy with ignore_eos. The plain run
(no prediction: the engine's lookahead as configured) gives the output O; then the same request with
`prediction` = O (a client that knows the answer: the upper bound, every draft accepted) at draft lengths
2, 4, 8; an edited O (one token in ten replaced, three inserted, three deleted: an edit of a file); a wrong
prediction (random tokens); prompt lookup alone (`speculative_ngram`: drafts from the request's own tokens;
random weights loop or not, so its rate here says nothing about real text). The same at 4 concurrent
requests. Every run must give O again: "same" in the table (greedy; the engine guarantees it for sampling
too, tests/engine/test_speculative.py). Random weights make acceptance a property of the prediction given,
not of the model: read the exact-prediction rows as what a verify step costs and yields, not as a rate to
expect on real text.

The draft length is EngineConfig.speculative_tokens; this benchmark sets it on the running engine between
requests (the scheduler reads it per step), so every variant shares one engine and its CUDA graphs.

JSON and a PNG under bench/results/ (speculative_<device>.{json,png}); a table printed last.
"""

from __future__ import annotations

import argparse
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
    snap0 = engine.metrics.snapshot()
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
    snap = engine.metrics.snapshot()
    # from the step that delivered the first tokens (the prefill's) to the last: decode only
    first = next(i for i, (_, n) in enumerate(stamps) if n)
    span = stamps[-1][0] - stamps[first][0]
    tokens = sum(n for _, n in stamps[first + 1:])
    return {"outputs": [outs[r] for r in ids], "decode_s": span, "decode_tokens": tokens,
            "tok_s": tokens / span, "decode_steps": len(stamps) - first - 1,
            "ms_per_step": 1e3 * span / max(1, len(stamps) - first - 1),
            "drafted": snap["draft_tokens_total"] - snap0["draft_tokens_total"],
            "accepted": snap["draft_accepted_total"] - snap0["draft_accepted_total"]}


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
        variants = [("plain", None, 0, False)]
        variants += [(f"exact prediction, k={k}", [tuple(o) for o in plain["outputs"]], k, False) for k in (2, 4, 8)]
        variants += [("edited prediction, k=4", [tuple(edit(o, vocab, i)) for i, o in enumerate(plain["outputs"])], 4, False),
                     ("wrong prediction, k=4", wrong, 4, False),
                     ("prompt lookup, k=4", None, 4, True)]
        for name, preds, k, ngram in variants:
            r = plain if name == "plain" else run(engine, ps, out_len, preds, k, ngram, f"{name}{batch}")
            row = {"batch": batch, "variant": name, "same": r["outputs"] == plain["outputs"],
                   **{key: v for key, v in r.items() if key != "outputs"}}
            row["vs_plain"] = row["tok_s"] / plain["tok_s"]
            row["tokens_per_step"] = row["decode_tokens"] / max(1, row["decode_steps"]) / batch
            row["acceptance"] = row["accepted"] / row["drafted"] if row["drafted"] else None
            rows.append(row)
            print(f"b{batch} {name}: {row['tok_s']:.0f} tok/s ({row['vs_plain']:.2f}x), {row['ms_per_step']:.3f} ms "
                  f"per step, {row['tokens_per_step']:.2f} tokens per step per request, same {row['same']}", flush=True)
    return rows


def build_engine(args) -> LLMEngine:
    if args.model == "tiny":
        from model.tiny import tiny_config

        model_config = tiny_config()
    else:
        from model.config import GptOssConfig

        model_config = GptOssConfig.preset(args.model)
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
    print(f"{'batch':>5} {'variant':<26} {'tok/s/req':>9} {'vs plain':>8} {'ms/step':>8} {'tok/step':>8} "
          f"{'accept':>6} same")
    for r in result["rows"]:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        print(f"{r['batch']:>5} {r['variant']:<26} {r['tok_s'] / r['batch']:>9.1f} {r['vs_plain']:>8.2f} "
              f"{r['ms_per_step']:>8.3f} {r['tokens_per_step']:>8.2f} {acc:>6} {r['same']}")


if __name__ == "__main__":
    main()
