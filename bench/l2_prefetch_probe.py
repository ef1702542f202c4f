"""Does `cp.async.bulk.prefetch.L2` put a decode weight into L2, and how fast?

    python -m bench.l2_prefetch_probe [--out bench/results/l2_prefetch_probe_h200.json]

Per weight shape (the 20b QKV and O projections, a stacked pair of down-sized experts) and prefetch
chunk size, eagerly, many repetitions, kernel times from the profiler (CUPTI: device time only):
- cold: flush L2 (write 256 MB), spin ~50 us, F.linear at T=1;
- prefetched: flush, the prefetch kernel, spin ~50 us (the prefetches are asynchronous to the kernel
  that issues them), F.linear;
- warm: F.linear right after another F.linear on the same weight (the L2 ceiling).
Prints a table (mean us of the linear, and of the prefetch kernel itself), writes JSON.

`--loads` (the load-based variant): the same three cases with a kernel of P programs that really loads
the weight (summing it into a sink, so nothing is optimized away; plain or `evict_last` loads), and then
the question that decides whether a side stream pays: in a CUDA graph, after an L2 flush, the main
stream runs a stand-in for the small kernels before the projection (a spin of S us, or a 16 MB read as
a long-context attention layer would do) and then F.linear, while a forked side stream loads the weight;
graph time with and without the side stream (CUDA events, median over replays). Result (H200,
2026-11-30, bench/results/l2_load_probe_h200.json): the loads leave the weight little more usable than
the bulk prefetch did, and the side stream slows every graph (kernels/moe/NOTES.md).

Why it exists: prefetching the next QKV / O / active experts' down weights into L2 on a side stream,
during the small kernels of a batch-1 decode step, measured 5% slower (kernels/moe/NOTES.md, "L2
prefetch"; the side-stream code was commit 44714ed, removed since). This probe showed the bulk
prefetches land only a fraction of the bytes in L2 (H200, 2026-11-30,
bench/results/l2_prefetch_probe_h200.json): the starting point for a load-based variant.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

CHUNKS_PER_PROGRAM = 32  # one warp, one piece per lane


@triton.jit
def _prefetch_kernel(base_ptr, nbytes, sink_ptr, CHUNK: tl.constexpr, PER: tl.constexpr):
    """Bulk-prefetch bytes [0, nbytes) of base_ptr (uint8, 16-byte aligned, nbytes a multiple of 16)."""
    pid = tl.program_id(0)
    offs = (pid * PER + tl.arange(0, PER)).to(tl.int64) * CHUNK
    offs = tl.minimum(offs, ((nbytes - 1) // CHUNK) * CHUNK)  # lanes past the end repeat the last piece
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
    done = tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                     [base_ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + pid, tl.sum(done))  # keeps the asm; the sink is never read


@triton.jit
def _load_kernel(base_ptr, n_words, per_program, sink_ptr, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    """Load int32 words [pid * per_program, (pid + 1) * per_program) of base_ptr and store their sum."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for off in range(0, per_program, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        acc += tl.load(base_ptr + idx, mask=idx < n_words, other=0, eviction_policy=EVICT)
    tl.store(sink_ptr + pid, tl.sum(acc))


def load_now(w: torch.Tensor, sink: torch.Tensor, programs: int, evict: str, block: int = 4096) -> None:
    flat = w.view(-1).view(torch.int32)
    per = triton.cdiv(triton.cdiv(flat.numel(), programs), block) * block
    _load_kernel[(programs,)](flat, flat.numel(), per, sink, BLOCK=block, EVICT=evict, num_warps=8)


SHAPES = {"qkv 5120x2880 bf16": (5120, 2880), "o 2880x4096 bf16": (2880, 4096), "down x2 5888x2880 bf16": (5888, 2880)}


def prefetch_now(w: torch.Tensor, sink: torch.Tensor, chunk: int) -> None:
    flat = w.view(-1).view(torch.uint8)
    nbytes = flat.numel() // 16 * 16
    grid = (triton.cdiv(triton.cdiv(nbytes, chunk), CHUNKS_PER_PROGRAM),)
    _prefetch_kernel[grid](flat, nbytes, sink, CHUNK=chunk, PER=CHUNKS_PER_PROGRAM, num_warps=1)


def kernel_means(fn, reps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / e.count for e in prof.key_averages() if e.device_time_total > 0}


def linear_us(means: dict[str, float]) -> float:
    names = [k for k in means if "gemv" in k.lower() or "gemm" in k.lower() or "nvjet" in k.lower() or "cublas" in k.lower()]
    return sum(means[k] for k in names)


def shape_row(name: str, n: int, k: int, flush: torch.Tensor, reps: int):
    """A random [n, k] bf16 weight, F.linear on one token over it, and the row's cold / warm timings."""
    w = torch.randn(n, k, device=flush.device, dtype=torch.bfloat16)
    x = torch.randn(1, k, device=flush.device, dtype=torch.bfloat16)
    lin = lambda: torch.nn.functional.linear(x, w)  # noqa: E731

    def cold():
        flush.fill_(1)
        torch.cuda._sleep(100_000)
        lin()

    row = {"shape": name, "mb": n * k * 2 / 1e6, "cold_us": linear_us(kernel_means(cold, reps)),
           "warm_us": linear_us(kernel_means(lambda: (lin(), lin()), reps)) / 2}
    return w, lin, row


def graph_us(fn, reps: int) -> float:
    """Median us of one replay of a CUDA graph of fn (captured after a warm-up)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def load_rows(args, flush: torch.Tensor, sink: torch.Tensor) -> list[dict]:
    dev = flush.device
    side = torch.cuda.Stream(dev)
    kv = torch.randn(8 * 2**20, device=dev, dtype=torch.bfloat16)  # 16 MB: a full layer's K/V at 8k
    cycles_per_us = 1980.0  # the H200's SM clock under load, MHz (torch.cuda._sleep spins clock cycles)
    rows = []
    for name, (n, k) in list(SHAPES.items())[:2]:
        w, lin, row = shape_row(name, n, k, flush, args.reps)
        for evict in ("", "evict_last"):
            for programs in map(int, args.programs.split(",")):
                def pre(programs=programs, evict=evict):
                    flush.fill_(1)
                    load_now(w, sink, programs, evict)
                    torch.cuda._sleep(100_000)
                    lin()

                means = kernel_means(pre, args.reps)
                tag = f"{evict or 'plain'}_{programs}"
                row[f"loaded_{tag}_us"] = linear_us(means)
                row[f"load_kernel_{tag}_us"] = sum(v for key, v in means.items() if "_load_kernel" in key)
        for stand_in in [f"spin{s}" for s in args.spins.split(",")] + ["kv16MB"]:
            def before(stand_in=stand_in):
                if stand_in == "kv16MB":
                    kv.sum()
                else:
                    torch.cuda._sleep(int(float(stand_in[4:]) * cycles_per_us))

            def plain(before=before):
                flush.fill_(1)
                before()
                lin()

            row[f"graph_{stand_in}_us"] = graph_us(plain, args.reps)
            for programs in map(int, args.programs.split(",")):
                def forked(before=before, programs=programs):
                    flush.fill_(1)
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        load_now(w, sink, programs, "evict_last")
                    before()
                    lin()
                    torch.cuda.current_stream().wait_stream(side)

                row[f"graph_{stand_in}_side{programs}_us"] = graph_us(forked, args.reps)
        row["graph_flush_only_us"] = graph_us(lambda: flush.fill_(1), args.reps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--chunks", default="4096,16384,65536")
    p.add_argument("--out", default="bench/results/l2_prefetch_probe.json")
    p.add_argument("--loads", action="store_true", help="the load-based prefetch and the side-stream graphs")
    p.add_argument("--programs", default="16,33,66,132")
    p.add_argument("--spins", default="5,10,20")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    sink = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
    rows = load_rows(args, flush, sink) if args.loads else []
    for name, (n, k) in ({} if args.loads else SHAPES).items():
        w, lin, row = shape_row(name, n, k, flush, args.reps)
        for chunk in map(int, args.chunks.split(",")):
            def pre(chunk=chunk):
                flush.fill_(1)
                prefetch_now(w, sink, chunk)
                torch.cuda._sleep(100_000)
                lin()

            means = kernel_means(pre, args.reps)
            row[f"prefetched_{chunk}_us"] = linear_us(means)
            row[f"prefetch_kernel_{chunk}_us"] = sum(v for key, v in means.items() if "prefetch" in key)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
