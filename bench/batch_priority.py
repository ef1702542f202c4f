"""What a running /v1/batches batch does to interactive requests, with its lines at engine priority 1 (the default,
`ingress.batch_priority`) against 0 (the same as interactive ones): one process, the app over an in-process engine on
the embedded tiny model (CPU, or `--device cuda`), no Ray.

    python -m bench.batch_priority --out bench/results/batch_priority_cpu.json

Per setting: a batch of `--lines` chat requests (`--batch-tokens` output tokens each, `--batch-concurrency` in
flight) is created over ASGI, and once it runs, `--probes` interactive chat requests (`--probe-tokens` output tokens,
one at a time) are timed end to end (those that end while the batch still runs count as "during"); then the batch
is waited for, and one more interactive request times the idle engine. The engine has `--max-num-seqs` seats, fewer
than the batch keeps in flight, so interactive requests find them taken: at priority 0 they queue behind the batch's
lines (first come, first served), at 1 they go first and preempt batch lines for a seat. Prints a table, writes JSON
and a PNG beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

DATE = "2026-12-07"


def chat(content: str, max_tokens: int) -> dict:
    return {"model": "gpt-oss", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}


async def one_setting(backend, priority: int, args) -> dict:
    import httpx

    from serve_app.openai_api.app import create_app
    from serve_app.openai_api.stored_responses import MemoryResponseStore

    app = create_app(backend, model_name="gpt-oss", max_context=4096, conversation_start_date=DATE,
                     response_store=MemoryResponseStore(), batch_priority=priority,
                     batch_concurrency=args.batch_concurrency)
    lines = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": chat(f"Batch line {i}: tell a story.", args.batch_tokens)}) + "\n"
                    for i in range(args.lines))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench", timeout=None) as http:
        upload = (await http.post("/v1/files", data={"purpose": "batch"},
                                  files={"file": ("b.jsonl", lines.encode())})).json()
        started = time.perf_counter()
        batch = (await http.post("/v1/batches", json={"input_file_id": upload["id"], "completion_window": "24h",
                                                      "endpoint": "/v1/chat/completions"})).json()
        await asyncio.sleep(args.warm_s)  # the batch's lines fill the engine's seats
        latencies, during = [], []
        for i in range(args.probes):
            t = time.perf_counter()
            answer = await http.post("/v1/chat/completions", json=chat(f"Interactive {i}: hi", args.probe_tokens))
            assert answer.status_code == 200, answer.text
            latencies.append((time.perf_counter() - t) * 1e3)
            # whether the batch still ran when this probe ended (else it ran, at least in part, on an idle engine)
            during.append((await http.get(f"/v1/batches/{batch['id']}")).json()["status"] == "in_progress")
        while (batch := (await http.get(f"/v1/batches/{batch['id']}")).json())["status"] not in (
                "completed", "failed", "cancelled", "expired"):
            await asyncio.sleep(0.1)
        assert batch["status"] == "completed", batch
        batch_s = time.perf_counter() - started
        t = time.perf_counter()
        idle = await http.post("/v1/chat/completions", json=chat("Interactive, idle: hi", args.probe_tokens))
        assert idle.status_code == 200, idle.text
        idle_ms = (time.perf_counter() - t) * 1e3
    busy = [ms for ms, d in zip(latencies, during) if d]
    return {"batch_priority": priority, "probe_ms": latencies, "probe_during_batch": during,
            "during_p50_ms": statistics.median(busy) if busy else None, "during_max_ms": max(busy, default=None),
            "probes_during": len(busy), "idle_ms": idle_ms, "batch_s": batch_s, "batch_counts": batch["request_counts"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=48)
    parser.add_argument("--batch-tokens", type=int, default=48)
    parser.add_argument("--batch-concurrency", type=int, default=16)
    parser.add_argument("--probes", type=int, default=6)
    parser.add_argument("--probe-tokens", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--warm-s", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="bench/results/batch_priority_cpu.json")
    args = parser.parse_args()

    from engine.async_engine import AsyncEngine
    from engine.cli import default_model_dir, ensure_tiny_model
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    folder = ensure_tiny_model(default_model_dir())
    engine = LLMEngine.from_checkpoint(folder, EngineConfig(max_num_seqs=args.max_num_seqs, device=args.device,
                                                            max_model_len=4096))
    backend = AsyncEngine(engine)
    try:
        async def every_setting() -> list[dict]:  # one event loop: the engine's deltas come to it
            return [await one_setting(backend, priority, args) for priority in (0, 1, 0, 1)]

        rows = asyncio.run(every_setting())
    finally:
        backend.shutdown()
        engine.close()
    print(f"{'batch priority':>14} | {'interactive during the batch: p50':>33} {'max':>8} {'of':>3} | {'idle':>7} | "
          f"{'batch done':>10}")
    for r in rows:
        p50, top = (f"{r[k]:.0f} ms" if r[k] is not None else "-" for k in ("during_p50_ms", "during_max_ms"))
        print(f"{r['batch_priority']:>14} | {p50:>33} {top:>8} {r['probes_during']:>3} | {r['idle_ms']:>4.0f} ms | "
              f"{r['batch_s']:>8.1f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "batch_priority", "date": time.strftime("%Y-%m-%d"),
                               "cpu": platform.processor() or platform.machine(), "device": args.device,
                               "args": vars(args), "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for n, r in enumerate(rows):
        ax.plot(range(1, len(r["probe_ms"]) + 1), r["probe_ms"], "o-" if r["batch_priority"] else "s--",
                label=f"batch priority {r['batch_priority']} (run {n // 2 + 1})")
    ax.set_xlabel("interactive request (one at a time, during the batch)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title("Interactive requests while a /v1/batches batch runs")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
