"""Does `cp.async.bulk.prefetch.L2` put a decode weight into L2, and how fast?

    python -m bench.l2_prefetch_probe [--out bench/results/l2_prefetch_probe_h200.json]

Per weight shape (the 20b QKV and O projections, a stacked pair of down-sized experts) and prefetch
chunk size, eagerly, many repetitions, kernel times from the profiler (CUPTI: device time only):
- cold: flush L2 (write 256 MB), spin ~50 us, F.linear at T=1;
- prefetched: flush, the prefetch kernel, spin ~50 us (the prefetches are asynchronous to the kernel
  that issues them), F.linear;
- warm: F.linear right after another F.linear on the same weight (the L2 ceiling).
Prints a table (mean us of the linear, and of the prefetch kernel itself), writes JSON.

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--chunks", default="4096,16384,65536")
    p.add_argument("--out", default="bench/results/l2_prefetch_probe.json")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    sink = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        lin = lambda: torch.nn.functional.linear(x, w)  # noqa: E731

        def cold():
            flush.fill_(1)
            torch.cuda._sleep(100_000)
            lin()

        row = {"shape": name, "mb": n * k * 2 / 1e6, "cold_us": linear_us(kernel_means(cold, args.reps)),
               "warm_us": linear_us(kernel_means(lambda: (lin(), lin()), args.reps)) / 2}
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
