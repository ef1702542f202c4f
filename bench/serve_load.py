"""Load an OpenAI-compatible chat endpoint through the `openai` client and time what a user sees.

    python -m bench.serve_load --url http://127.0.0.1:8000 --model gpt-oss-20b \\
        --concurrency 1,8,32 --requests 64 --prompt-tokens 1024 --max-tokens 256

For each concurrency level: `--requests` streamed chat completions (`stream_options.include_usage`),
at most that many in flight; per request the time to the first chunk (TTFT: this server starts its
stream once the request's first token exists), the time per output token after the first (TPOT, from
the usage the server reports) and the gaps between text chunks (ITL). The Harmony parser holds text
until a message header completes, so with random weights (whose tokens rarely form one) chunks carry
several tokens: TTFT and TPOT still hold, ITL is per chunk (tokens per chunk says how coarse). Then a
table, JSON and a PNG under bench/results/. Bad requests are sent too (`--error-checks`): each must come back as an HTTP 4xx in
OpenAI's error shape.

`--launch key=value ...` first starts this project's Serve app on a local Ray (the same arguments as
`serve run serve_app:app`), waits until it answers, loads it, reads each decode replica's counters
(K/V transfers by transport, fallbacks) and stops it. Without `--launch` the endpoint can be any
OpenAI-compatible server (vLLM, SGLang, ...), so one command measures them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.serve_launch import api_key

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between text chunks after the first
    chunks: int = 0  # chunks that carried text
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or not self.completion_tokens or self.completion_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


def build_prompts(count: int, prompt_tokens: int, seed: int = 0) -> list[str]:
    """`count` distinct user messages of ~`prompt_tokens` o200k tokens each (random common words; each
    begins with its own index, so no two share a prefix beyond the system message)."""
    from serve_app.harmony.encoding import load_harmony_encoding

    encoding = load_harmony_encoding()
    rng = random.Random(seed)
    words = ("time person year way day thing man world life hand part child eye woman place work week case "
             "point number group problem fact water light river stone cloud paper garden window music "
             "story island market engine signal forest winter summer mountain letter").split()
    prompts = []
    for i in range(count):
        text = f"{i}: " + " ".join(rng.choice(words) for _ in range(prompt_tokens + 16))
        ids = encoding.encode(text, allowed_special=set())[:prompt_tokens]
        prompts.append(encoding.decode(ids))
    return prompts


async def one_request(client, model: str, content: str, max_tokens: int) -> RequestResult:
    t0 = time.perf_counter()
    first = last = None
    result = RequestResult(ok=False)
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
            temperature=0.0, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            now = time.perf_counter()
            if first is None:
                first = now  # this server answers once the first token exists (its role chunk)
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                delta = choice.delta
                text = (delta.content or "") + (getattr(delta, "reasoning_content", None) or "")
                if text or delta.tool_calls:
                    if last is not None:
                        result.itl_s.append(now - last)
                    last = now
                    result.chunks += 1
        result.ok = True
    except Exception as err:  # noqa: BLE001 - a failed request is a result, not the end of the run
        result.error = f"{type(err).__name__}: {err}"[:300]
    result.e2e_s = time.perf_counter() - t0
    result.ttft_s = None if first is None else first - t0
    return result


async def run_level(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int,
                    timeout_s: float) -> tuple[list[RequestResult], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key(), max_retries=0, timeout=timeout_s)
    gate = asyncio.Semaphore(concurrency)

    async def gated(content: str) -> RequestResult:
        async with gate:
            return await one_request(client, model, content, max_tokens)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(gated(p) for p in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    return list(results), wall


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize(results: list[RequestResult], wall_s: float, concurrency: int) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    ms = lambda v: None if v is None else round(v * 1e3, 2)  # noqa: E731
    return {
        "concurrency": concurrency, "requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5], "wall_s": round(wall_s, 3),
        "prompt_tokens_mean": round(in_tokens / len(ok), 1) if ok else None,
        "completion_tokens_mean": round(out_tokens / len(ok), 1) if ok else None,
        "output_tok_s": round(out_tokens / wall_s, 1), "total_tok_s": round((in_tokens + out_tokens) / wall_s, 1),
        "requests_per_s": round(len(ok) / wall_s, 3),
        "ttft_ms": {"mean": ms(statistics.fmean(ttft)) if ttft else None, "p50": ms(_pct(ttft, 50)),
                    "p90": ms(_pct(ttft, 90)), "p99": ms(_pct(ttft, 99))},
        "tpot_ms": {"mean": ms(statistics.fmean(tpot)) if tpot else None, "p50": ms(_pct(tpot, 50)),
                    "p99": ms(_pct(tpot, 99))},
        "itl_ms": {"p50": ms(_pct(itl, 50)), "p99": ms(_pct(itl, 99)), "max": ms(max(itl)) if itl else None},
        "tokens_per_chunk": round(out_tokens / max(1, sum(r.chunks for r in ok)), 3),
    }


ERROR_CHECKS = [  # (what, body): each must be refused with a 4xx in OpenAI's error shape
    ("empty messages", {"messages": []}),
    ("unknown model", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
    ("max_tokens 0", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
    ("max_tokens past the context", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}),
    ("unknown field", {"messages": [{"role": "user", "content": "hi"}], "no_such_field": 1}),
]


def error_checks(url: str, model: str) -> list[dict]:
    """Send each bad request; record the status and whether the body is OpenAI's error object."""
    import httpx

    out = []
    with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {api_key()}"}) as http:
        for what, body in ERROR_CHECKS:
            resp = http.post(f"{url}/v1/chat/completions", json={"model": model, **body})
            try:
                err = resp.json().get("error", {})
                shaped = isinstance(err, dict) and {"message", "type"} <= err.keys()
            except ValueError:
                shaped = False
            out.append({"check": what, "status": resp.status_code, "openai_error_shape": shaped,
                        "passed": 400 <= resp.status_code < 500 and shaped})
    return out


def print_table(levels: list[dict]) -> None:
    head = ("conc", "ok/req", "TTFT p50", "p99", "TPOT p50", "ITL p99", "max", "out tok/s", "tok/chunk")
    print(" | ".join(head))
    for s in levels:
        row = (s["concurrency"], f"{s['ok']}/{s['requests']}", s["ttft_ms"]["p50"], s["ttft_ms"]["p99"],
               s["tpot_ms"]["p50"], s["itl_ms"]["p99"], s["itl_ms"]["max"], s["output_tok_s"], s["tokens_per_chunk"])
        print(" | ".join(str(v) for v in row))


def plot(levels: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [s for s in levels if s["ok"]]  # a level where every request failed has no times to draw
    if not levels:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    conc = [s["concurrency"] for s in levels]
    axes[0].plot(conc, [s["output_tok_s"] for s in levels], "o-")
    axes[0].set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s", title="throughput")
    for key, style in (("p50", "o-"), ("p99", "s--")):
        axes[1].plot(conc, [s["ttft_ms"][key] for s in levels], style, label=f"TTFT {key}")
        axes[1].plot(conc, [s["tpot_ms"][key] for s in levels], style, label=f"TPOT {key}")
    axes[1].set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="ms", title="latency")
    axes[1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(url: str, model: str, concurrencies: list[int], requests: int, prompt_tokens: int, max_tokens: int,
        seed: int = 0, timeout_s: float = 600.0, warmup: int = 2, probe=None) -> list[dict]:
    """One summary per concurrency level; `probe` (bench.serve_launch.ServerProbe) adds the server's side."""
    prompts = build_prompts(requests + warmup, prompt_tokens, seed)
    if warmup:  # first requests pay one-time costs (kernel variants, connections): not timed
        asyncio.run(run_level(url, model, prompts[requests:], max_tokens, warmup, timeout_s))
    levels = []
    for c in concurrencies:
        if probe is not None:
            probe.start()
        results, wall = asyncio.run(run_level(url, model, prompts[:requests], max_tokens, c, timeout_s))
        levels.append(summarize(results, wall, c))
        if probe is not None:
            levels[-1]["server"] = probe.finish(wall)
    return levels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (the client adds /v1)")
    p.add_argument("--model", default="gpt-oss", help="model name the server expects")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated in-flight limits, one level each")
    p.add_argument("--requests", type=int, default=64, help="requests per level")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="o200k tokens of each user message")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--warmup", type=int, default=2, help="untimed requests first")
    p.add_argument("--error-checks", action="store_true", help="also send bad requests (must get 4xx)")
    p.add_argument("--launch", nargs="*", metavar="KEY=VALUE",
                   help="start serve_app here first with these `serve run` arguments (local Ray)")
    p.add_argument("--num-gpus", type=int, help="with --launch: GPUs of the local Ray (default: all)")
    p.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS",
                   help="with --launch: record the decode and ingress replicas' processes with py-spy for SECONDS "
                        "(threads, then GIL holders) --py-spy-delay into each level; summary in the level's "
                        "`server.py_spy` "
                        "(bench/pyspy_summary.py), recordings beside the JSON")
    p.add_argument("--py-spy-delay", type=float, default=10.0, metavar="SECONDS",
                   help="how far into each level the --py-spy recording starts (past the level's first prompts)")
    p.add_argument("--label", default="serve_load", help="file name stem under bench/results")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    launched = None
    url, model = args.url, args.model
    if args.launch is not None:
        from bench.serve_launch import LaunchedApp

        launched = LaunchedApp(args.launch, num_gpus=args.num_gpus)
    try:
        if launched is not None:  # inside the try: a failed start still stops the Ray it started
            url, model = launched.start(), launched.model_name
        t0 = time.perf_counter()
        probe = None
        if launched is not None:
            from bench.serve_launch import ServerProbe

            probe = ServerProbe(launched, py_spy_s=args.py_spy, py_spy_delay_s=args.py_spy_delay,
                                out_dir=Path(args.out_dir))
            Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        levels = run(url, model, concurrencies, args.requests, args.prompt_tokens, args.max_tokens, args.seed,
                     args.timeout_s, args.warmup, probe)
        checks = error_checks(url, model) if args.error_checks else []
        replicas = launched.replica_stats() if launched else None
        listener = launched.http_listener() if launched else None
    finally:
        if launched is not None:
            launched.stop()
    result = {"date": time.strftime("%Y-%m-%d"), "url": url, "model": model, "launch": args.launch,
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "levels": levels,
              "error_checks": checks, "replicas": replicas, "run_s": round(time.perf_counter() - t0, 1)}
    if launched is not None:
        result["startup_s"] = launched.startup_s
        result["http_listener"] = listener  # HAProxy (RAY_SERVE_ENABLE_HA_PROXY=1) or Serve's Python proxy
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.label}.json").write_text(json.dumps(result, indent=2))
    plot(levels, out / f"{args.label}.png", f"{model}: {args.prompt_tokens} in / {args.max_tokens} out")
    print_table(levels)
    for s in levels:
        if "server" in s:
            print(f"concurrency {s['concurrency']}: engines {json.dumps(s['server']['engines'])}; "
                  f"CPU cores busy {json.dumps(s['server']['cpu_cores_busy'])}")
            for name, spied in s["server"].get("py_spy", {}).items():
                print(f"concurrency {s['concurrency']}: {name} (py-spy) {json.dumps(spied)}")
    for c in checks:
        print(f"error check {c['check']!r}: HTTP {c['status']}, OpenAI shape {c['openai_error_shape']}")
    if replicas:
        print("replicas:", json.dumps(replicas))
    if launched is not None:
        print(f"HTTP listener: {result['http_listener']}")
    failed = sum(s["failed"] for s in levels) + sum(not c["passed"] for c in checks)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
