"""How many tokens per second one decode replica can stream to the ingress through Ray Serve, and what AsyncEngine's
`stream_items_per_s` changes: an engine stand-in paced like a GPU step, on a local Ray, no GPU.

    python -m bench.serve_stream_capacity --out bench/results/serve_stream_capacity_cpu.json
    RAY_SERVE_THROUGHPUT_OPTIMIZED=1 python -m bench.serve_stream_capacity --out ..._throughput_optimized_cpu.json

Each Ray Serve streaming item (one TokenDelta from the decode replica's generator to the ingress' DeploymentHandle)
has a fixed CPU cost on both sides (ray-project/ray#52745 reports the same at high concurrency), paid in the decode
replica's process, whose GIL the engine thread shares. `PacedEngine` stands in for LLMEngine behind the real
AsyncEngine: each step holds the GIL for `--host-ms` plus `--host-us-per-seq` per running sequence (Python work, as
the engine's host side), then sleeps what is left of `--device-ms` with the GIL released (a lookahead step waiting
on the GPU), and gives every running request one token. The caller is the ingress' own ServeTokenBackend in another
replica. Per (streams, stream_items_per_s): output tokens per second the caller received, Ray items per second,
tokens per item, the engine's mean step time against its pace and mean running requests, and the CPU each process
used per token. Rows with `ray: false` run the same engine and consumers in one process without Ray: the engine's
own rate. Prints a table; writes JSON and a PNG beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path
from types import SimpleNamespace

from engine.request import FINISH_LENGTH, GenerateRequest, SamplingParams, TokenDelta

VOCAB = 201088


class PacedEngine:
    """The part of LLMEngine's interface AsyncEngine uses, with steps paced like a GPU's (see the module doc)."""

    def __init__(self, device_s: float, host_s: float, host_s_per_seq: float, max_model_len: int = 8192):
        self.device_s, self.host_s, self.host_s_per_seq = device_s, host_s, host_s_per_seq
        self.max_model_len = max_model_len
        self.runner = SimpleNamespace(device=SimpleNamespace(type="cpu"))
        self.scheduler = SimpleNamespace(running=[])
        self.metrics = SimpleNamespace(snapshot=lambda: {})
        self._running: dict[str, list] = {}  # request id -> [tokens made, max_tokens, prompt length]
        self.steps = 0
        self.step_s = 0.0
        self.made = 0  # tokens made, over all steps

    def validate(self, request: GenerateRequest) -> None:
        request.validate(VOCAB, self.max_model_len)

    def add_request(self, request: GenerateRequest, prefill_only: bool = False) -> None:
        self._running[request.request_id] = [0, request.sampling.max_tokens, len(request.prompt_ids)]
        self.scheduler.running = list(self._running)

    def abort(self, request_id: str) -> TokenDelta | None:
        state = self._running.pop(request_id, None)
        self.scheduler.running = list(self._running)
        return None if state is None else TokenDelta(request_id, [], finish_reason="abort", num_prompt_tokens=state[2],
                                                     num_output_tokens=state[0])

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def step(self) -> list[TokenDelta]:
        start = time.perf_counter()
        busy_until = start + self.host_s + self.host_s_per_seq * len(self._running)
        spins = 0
        while time.perf_counter() < busy_until:  # Python work holding the GIL, as the engine's host side does
            spins += 1
        left = self.device_s - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)  # the GPU's part of the step: the GIL is free
        deltas = []
        for rid, state in list(self._running.items()):
            state[0] += 1
            done = state[0] >= state[1]
            deltas.append(TokenDelta(rid, [1000 + state[0] % 1000], finish_reason=FINISH_LENGTH if done else None,
                                     num_prompt_tokens=state[2], num_output_tokens=state[0]))
            if done:
                del self._running[rid]
        self.scheduler.running = list(self._running)
        self.steps += 1
        self.step_s += time.perf_counter() - start
        self.made += len(deltas)
        return deltas


def make_engine(args, budget: float):
    from engine.async_engine import AsyncEngine

    paced = PacedEngine(args.device_ms / 1e3, args.host_ms / 1e3, args.host_us_per_seq / 1e6)
    return paced, AsyncEngine(paced, stream_items_per_s=budget)


def request(i: int, tokens: int) -> GenerateRequest:
    return GenerateRequest(f"r{i}-{time.monotonic_ns()}", [200006, 1, 2, 3],
                           SamplingParams(max_tokens=tokens, temperature=0.0))


async def consume(backend, streams: int, tokens: int) -> dict:
    """`streams` concurrent requests of `tokens` tokens each through `backend.generate`; what arrived."""
    items = got = 0

    async def one(i: int) -> None:
        nonlocal items, got
        async for delta in backend.generate(request(i, tokens)):
            items += 1
            got += len(delta.token_ids)

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(streams)))
    return {"wall_s": time.perf_counter() - t0, "items": items, "tokens": got, "cpu_s": time.process_time() - cpu0}


def run_local(args, streams: int, budget: float) -> dict:
    paced, engine = make_engine(args, budget)
    out = asyncio.run(consume(engine, streams, args.tokens))
    engine.shutdown()
    return {**out, "engine_cpu_s": out["cpu_s"], "caller_cpu_s": 0.0, "steps": paced.steps, "step_s": paced.step_s,
            "made": paced.made}


def serve_deployments(args):
    from ray import serve

    @serve.deployment(max_ongoing_requests=4096)
    class PacedDecode:
        def __init__(self, budget: float):
            self.paced, self.engine = make_engine(args, budget)

        async def generate(self, req: GenerateRequest):
            async for delta in self.engine.generate(req):
                yield delta

        async def abort(self, request_id: str) -> None:
            await self.engine.abort(request_id)

        def counters(self) -> dict:
            return {"steps": self.paced.steps, "step_s": self.paced.step_s, "made": self.paced.made,
                    "cpu_s": time.process_time()}

    @serve.deployment(max_ongoing_requests=16)
    class Caller:
        def __init__(self, decode):
            from serve_app.ingress import ServeTokenBackend

            self.decode = decode
            self.backend = ServeTokenBackend(decode, max_context=8192)

        async def run(self, streams: int, tokens: int) -> dict:
            before = await self.decode.counters.remote()
            out = await consume(self.backend, streams, tokens)
            after = await self.decode.counters.remote()
            return {**out, "caller_cpu_s": out["cpu_s"], "engine_cpu_s": after["cpu_s"] - before["cpu_s"],
                    "steps": after["steps"] - before["steps"], "step_s": after["step_s"] - before["step_s"],
                    "made": after["made"] - before["made"]}

    return PacedDecode, Caller


def run_serve(args, levels: list[int], budget: float) -> list[dict]:
    from ray import serve

    PacedDecode, Caller = serve_deployments(args)
    caller = serve.run(Caller.bind(PacedDecode.bind(budget)), name="stream_capacity", route_prefix=None)

    async def drive() -> list[dict]:
        await caller.run.remote(8, 16)  # warm: connections, routers
        return [await caller.run.remote(streams, args.tokens) | {"streams": streams} for streams in levels]

    rows = on_loop(drive())
    on_loop(asyncio.to_thread(serve.delete, "stream_capacity"))
    return rows


_LOOP: asyncio.AbstractEventLoop | None = None


def on_loop(coroutine):
    """Run a coroutine on one long-lived event-loop thread: handles are awaited there, as
    RAY_SERVE_THROUGHPUT_OPTIMIZED=1 requires, and their routers' loop outlives them (until serve.shutdown)."""
    global _LOOP
    if _LOOP is None:
        import threading

        _LOOP = asyncio.new_event_loop()
        threading.Thread(target=_LOOP.run_forever, name="bench-handles", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coroutine, _LOOP).result()


def summarize(raw: dict, streams: int, budget: float, ray_path: bool, args) -> dict:
    tokens = max(raw["tokens"], 1)
    return {"ray": ray_path, "streams": streams, "stream_items_per_s": budget,
            "tok_s": raw["tokens"] / raw["wall_s"], "items_s": raw["items"] / raw["wall_s"],
            "tokens_per_item": raw["tokens"] / max(raw["items"], 1),
            "step_ms": 1e3 * raw["step_s"] / max(raw["steps"], 1), "paced_step_ms": args.device_ms,
            "running_per_step": raw["made"] / max(raw["steps"], 1),
            "engine_cpu_us_per_token": 1e6 * raw["engine_cpu_s"] / tokens,
            "caller_cpu_us_per_token": 1e6 * raw["caller_cpu_s"] / tokens, **raw}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="64,256,512", help="concurrent requests, one level each")
    parser.add_argument("--budgets", default="0,2000,8000",
                        help="AsyncEngine stream_items_per_s values (deltas per second of all streams; 0: no limit)")
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    parser.add_argument("--device-ms", type=float, default=20.0, help="a step's pace (the GPU's time)")
    parser.add_argument("--host-ms", type=float, default=1.0, help="GIL-held host work per step")
    parser.add_argument("--host-us-per-seq", type=float, default=4.0, help="and per running sequence")
    parser.add_argument("--out", default="bench/results/serve_stream_capacity_cpu.json")
    args = parser.parse_args()
    levels = [int(s) for s in args.streams.split(",")]
    budgets = [float(b) for b in args.budgets.split(",")]

    rows = [summarize(run_local(args, n, 0.0), n, 0.0, False, args) for n in levels]
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        for budget in budgets:
            rows += [summarize(raw, raw["streams"], budget, True, args) for raw in run_serve(args, levels, budget)]
    finally:
        from ray import serve

        on_loop(asyncio.to_thread(serve.shutdown))
        ray.shutdown()

    print(f"{'path':>9} {'budget/s':>8} {'streams':>7} | {'tok/s':>8} {'items/s':>8} {'tok/item':>8} | "
          f"{'step ms':>7} (pace {args.device_ms:g}) {'running':>7} | {'engine us/tok':>13} {'caller us/tok':>13}")
    for r in rows:
        print(f"{'Serve' if r['ray'] else 'no Ray':>9} {r['stream_items_per_s']:>8.0f} {r['streams']:>7} | "
              f"{r['tok_s']:>8,.0f} {r['items_s']:>8,.0f} {r['tokens_per_item']:>8.2f} | {r['step_ms']:>7.2f}"
              f"{'':>11} {r['running_per_step']:>7.0f} | {r['engine_cpu_us_per_token']:>13.0f} "
              f"{r['caller_cpu_us_per_token']:>13.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "serve_stream_capacity", "date": time.strftime("%Y-%m-%d"),
                               "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                               "ray_serve_throughput_optimized": os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0"),
                               "args": vars(args), "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"), os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0") == "1")
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(rows: list[dict], path: Path, throughput_optimized: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    local = [r for r in rows if not r["ray"]]
    ax.plot([r["streams"] for r in local], [r["tok_s"] for r in local], "k--o", label="engine alone (no Ray)")
    for budget in sorted({r["stream_items_per_s"] for r in rows if r["ray"]}):
        pts = [r for r in rows if r["ray"] and r["stream_items_per_s"] == budget]
        ax.plot([r["streams"] for r in pts], [r["tok_s"] for r in pts], "o-",
                label=f"through Serve, stream_items_per_s {budget:g}" if budget else "through Serve, no budget")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s received")
    plane = "RAY_SERVE_THROUGHPUT_OPTIMIZED=1" if throughput_optimized else "Serve's default data plane"
    ax.set_title(f"One decode replica's tokens through Ray Serve (paced engine)\n{plane}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
