"""How long tokenizing a prompt stops the ingress' event loop: rendered in place against in a render worker
(serve_app/harmony/render_worker.py), in one process, on whatever CPU runs it (no GPU).

    python -m bench.ingress_render --out bench/results/ingress_render_cpu.json

Per prompt length: a chat prompt of random prose (one user message) is rendered `--rounds` times each way while a
ticker coroutine sleeps 1 ms at a time on the same loop; the longest gap between its wake-ups is how long every
stream that ingress replica serves would have stalled. Prints a table, writes JSON and a PNG beside it. The worker's
first call (its start, ~1 s) is left out: the ingress starts its workers when its replica starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from pathlib import Path

from serve_app.harmony.render import Prompt, UserMessage, prompt_chars, render_prompt
from serve_app.harmony.render_worker import RenderWorkers

VOCAB = ["the", "model", "streams", "tokens", "over", "HTTP", "über", "naïve", "42", "3.14", "(x)", "—", "日本語",
         "\n\n", "def", "return", "{", "}", "serve", "Ray"]


def prose(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCAB) for _ in range(n_words))


async def timed(pool: RenderWorkers, prompt: Prompt) -> tuple[float, float, int]:
    """(wall ms of the render, the ticker's longest gap in ms, tokens)."""
    gaps, done = [], False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.005)
    start = time.perf_counter()
    ids = await pool.run(prompt_chars(prompt), render_prompt, prompt)
    wall = time.perf_counter() - start
    done = True
    await tick
    return wall * 1e3, max(gaps) * 1e3, len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--words", default="1000,4000,16000,64000,128000",
                        help="prompt lengths in words of prose (~1.1 tokens each)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench/results/ingress_render_cpu.json")
    args = parser.parse_args()
    in_place, worker = RenderWorkers(workers=0), RenderWorkers(workers=1, min_chars=0)
    render_prompt(Prompt(history=[UserMessage("warm up")]))
    asyncio.run(worker.run(0, len, "start the worker"))
    rows = []
    for n in (int(w) for w in args.words.split(",")):
        prompt = Prompt(history=[UserMessage(prose(n, seed=n))])
        runs = {name: [asyncio.run(timed(pool, prompt)) for _ in range(args.rounds)]
                for name, pool in (("in_place", in_place), ("worker", worker))}
        row = {"words": n, "chars": prompt_chars(prompt), "tokens": runs["in_place"][0][2]}
        for name, results in runs.items():
            row[f"{name}_ms"] = statistics.median(r[0] for r in results)
            row[f"{name}_stall_ms"] = statistics.median(r[1] for r in results)
        rows.append(row)
    worker.close()
    print(f"{'tokens':>8} {'chars':>9} | {'in place: render':>16} {'stall':>7} | {'worker: render':>14} {'stall':>7}")
    for r in rows:
        print(f"{r['tokens']:>8} {r['chars']:>9} | {r['in_place_ms']:>13.1f} ms {r['in_place_stall_ms']:>4.1f} ms"
              f" | {r['worker_ms']:>11.1f} ms {r['worker_stall_ms']:>4.1f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "ingress_render", "date": time.strftime("%Y-%m-%d"),
                               "cpu": platform.processor() or platform.machine(), "rounds": args.rounds,
                               "note": "medians; stall = the longest gap of a 1 ms ticker on the same event loop",
                               "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    tokens = [r["tokens"] for r in rows]
    ax.plot(tokens, [r["in_place_stall_ms"] for r in rows], "o-", label="rendered in place")
    ax.plot(tokens, [r["worker_stall_ms"] for r in rows], "s-", label="in a render worker")
    ax.set_xscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("event loop stalled (ms)")
    ax.set_title("Tokenizing a prompt: the ingress event loop's longest stall")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
