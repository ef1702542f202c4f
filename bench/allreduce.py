"""The ranks' sums of a decode step: NCCL's all-reduce against the one-shot all-reduce over symmetric
memory (kernels/comm/symm_all_reduce.py), at decode sizes, eager and inside a CUDA graph.

    python -m bench.allreduce --world 2 --out bench/results/allreduce_h200x2.json     (a multi-GPU host)
    python -m bench.allreduce --world 2 --device cpu                    (CPU smoke run: gloo, no symm_mem)

Per size (tokens x hidden bf16; a 120b decode step sums [B, 2880] 73 times): each rank draws its part
from its own seed, so every rank can also compute the sum in fp32 (the pure-torch reference) and check
both methods against it (bf16 rounding of the sum: |err| <= 2^-7 |ref| + 1e-2). Then the time per call:
eager (`--iters` calls in a row) and replayed from one CUDA graph holding `--calls-per-graph` chained
calls (as in a captured decode step), whose final value is checked too (a buffer reused before every
peer had read it would corrupt it). Printed as a table, written as JSON; nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.distributed.executor import free_port
from engine.distributed.worker import NCCL_ENV  # never NVLink multicast on shared hosts


def part(rank: int, tokens: int, hidden: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + tokens)
    return torch.randn(tokens, hidden, generator=g).to(device=device, dtype=torch.bfloat16)


def reference(world: int, tokens: int, hidden: int) -> torch.Tensor:
    """The sum of every rank's part, in fp32 on the host."""
    return sum(part(r, tokens, hidden, "cpu").float() for r in range(world))


def check(name: str, got: torch.Tensor, ref: torch.Tensor) -> dict:
    err = (got.float().cpu() - ref).abs()
    ok = bool((err <= ref.abs() * 2**-7 + 1e-2).all())
    return {f"{name}_max_err": err.max().item(), f"{name}_ok": ok}


def time_eager(fn, x: torch.Tensor, iters: int, device) -> float:
    """Microseconds per call, `iters` calls in a row."""
    for _ in range(3):
        fn(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn(x)
        end.record()
        end.synchronize()
        return 1e3 * start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return 1e6 * (time.perf_counter() - t0) / iters


def time_graph(fn, x: torch.Tensor, calls: int, replays: int, world: int) -> tuple[float, torch.Tensor]:
    """Microseconds per call, replaying one graph of `calls` chained calls, and the graph's output. Each
    call sums the previous output over the ranks and divides by `world`, so after the first call every
    rank holds sum/world and keeps it: a call that read a peer's buffer before that peer had written it
    (or after it had moved on) shows up as a wrong final value."""
    def chain(y):
        y = y.clone()  # NCCL sums in place: without the copy each replay would start from the last one's sum
        for _ in range(calls):
            y = fn(y) / world
        return y

    chain(x.clone())  # warm-up outside the capture (both ranks)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    us = 1e3 * start.elapsed_time(end) / (replays * calls)
    out = out.clone()
    graph.reset()
    return us, out


def nccl_sum(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def worker(rank: int, args, port: int, results) -> None:
    os.environ.update(NCCL_ENV)
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world)
    sizes = [int(t) for t in args.tokens.split(",")]
    symm, symm_error = None, None
    if cuda:
        from kernels.comm import SymmMemAllReduce, SymmMemUnavailableError

        try:
            symm = SymmMemAllReduce(device, torch.bfloat16, max_bytes=max(sizes) * args.hidden * 2)
        except SymmMemUnavailableError as err:
            symm_error = str(err)
    rows = []
    for tokens in sizes:
        row = {"tokens": tokens, "bytes": tokens * args.hidden * 2}
        ref = reference(args.world, tokens, args.hidden)
        row.update(check("nccl", nccl_sum(part(rank, tokens, args.hidden, device)), ref))
        row["nccl_eager_us"] = time_eager(nccl_sum, part(rank, tokens, args.hidden, device), args.iters, device)
        if cuda:
            row["nccl_graph_us"], out = time_graph(nccl_sum, part(rank, tokens, args.hidden, device),
                                                   args.calls_per_graph, args.replays, args.world)
            row.update(check("nccl_graph", out, ref / args.world))
        if symm is not None:
            row.update(check("symm_mem", symm(part(rank, tokens, args.hidden, device)), ref))
            row["symm_mem_eager_us"] = time_eager(symm, part(rank, tokens, args.hidden, device), args.iters, device)
            row["symm_mem_graph_us"], out = time_graph(symm, part(rank, tokens, args.hidden, device),
                                                       args.calls_per_graph, args.replays, args.world)
            row.update(check("symm_mem_graph", out, ref / args.world))
        rows.append(row)
    if rank == 0:
        peers = {f"0->{r}": torch.cuda.can_device_access_peer(0, r) for r in range(1, args.world)} if cuda else {}
        results.put({"rows": rows, "symm_mem_error": symm_error, "peer_access": peers})
    dist.barrier()
    dist.destroy_process_group()


def run(args) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, results)) for r in range(args.world)]
    for p in procs:
        p.start()
    out = results.get(timeout=args.timeout_s)
    for p in procs:
        p.join(30)
        if p.exitcode != 0:
            raise RuntimeError(f"rank process {p.pid} exited with {p.exitcode}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256", help="rows of each tensor summed")
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--calls-per-graph", type=int, default=73, help="sums in one decode step of 120b at TP/EP")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--out", default="bench/results/allreduce.json")
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        p.error(f"--world {args.world} needs {args.world} CUDA GPUs, {torch.cuda.device_count()} visible")
    if args.device == "cpu":
        args.iters = min(args.iters, 20)
    result = run(args)
    record = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "world": args.world, "device":
              torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "args": vars(args), **result}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    if result["peer_access"]:
        print(f"peer access: {result['peer_access']}")
    if result["symm_mem_error"]:
        print(f"symm_mem unavailable: {result['symm_mem_error']}")
    print(f"{'tokens':>6s} {'KiB':>7s} {'nccl eager':>10s} {'nccl graph':>10s} {'symm eager':>10s} {'symm graph':>10s} "
          f"{'ok':>5s}   (us per call)")
    def all_ok(r: dict) -> bool:
        return all(v for k, v in r.items() if k.endswith("_ok"))

    for r in result["rows"]:
        ok = all_ok(r)
        cells = [f"{r.get(k, float('nan')):10.1f}" for k in ("nccl_eager_us", "nccl_graph_us", "symm_mem_eager_us",
                                                               "symm_mem_graph_us")]
        print(f"{r['tokens']:6d} {r['bytes'] / 1024:7.1f} {' '.join(cells)} {str(ok):>5s}")
    print(f"wrote {out}")
    return 0 if all(all_ok(r) for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
